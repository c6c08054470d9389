#!/usr/bin/env python
"""The draft-vocabulary ranking shipped for the presets' tokenizer (Qwen2.5's): the 1.5B's greedy
answers (its default path: the same text as plain decoding) to `prompts.jsonl`, 168 chat prompts
written for the repository in Spec-Bench's twelve kinds, their tokens counted, most used first
(`count_ranking`), written to `leapdecode/data/draft_vocab/`. Resumable: each answer is kept in
`answers.jsonl` as it is made.

    python docs/results/2026-12-08-draft-vocab-ranking/rank.py [--max-new-tokens 192]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from leapdecode import load_model, wrap
from leapdecode.heads.vocabulary import count_ranking, save_ranking, shipped_ranking_path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=192)
    args = parser.parse_args()
    prompts = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text(encoding="utf-8").splitlines()]
    answers_path = HERE / "answers.jsonl"
    answers = {}
    if answers_path.exists():
        for line in answers_path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            answers[row["index"]] = row["answer"]
    lm = load_model("qwen2.5-coder-1.5b")
    decoder = wrap(lm)
    began = time.perf_counter()
    with answers_path.open("a", encoding="utf-8") as out:
        for index, row in enumerate(prompts):
            if index in answers:
                continue
            messages = [{"role": "user", "content": row["prompt"]}]
            result = decoder.generate(messages, max_new_tokens=args.max_new_tokens)
            answers[index] = list(result.token_ids)
            out.write(json.dumps({"index": index, "category": row["category"], "answer": answers[index]}) + "\n")
            out.flush()
            took = time.perf_counter() - began
            print(f"{index + 1}/{len(prompts)} {len(result.token_ids)} tokens, {took:.0f} s", flush=True)
    ranking = count_ranking(answers[i] for i in sorted(answers))
    path = shipped_ranking_path(lm.tokenizer)
    source = (
        f"qwen2.5-coder-1.5b's greedy answers to {len(prompts)} chat prompts written for leapdecode "
        f"({sum(len(a) for a in answers.values())} tokens; docs/results/2026-12-08-draft-vocab-ranking)"
    )
    save_ranking(path, ranking, source)
    print(f"{len(ranking)} distinct tokens ranked in {path}")


if __name__ == "__main__":
    main()
