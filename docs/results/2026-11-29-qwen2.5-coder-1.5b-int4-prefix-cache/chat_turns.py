"""A chat's second turn with and without the prefix caches, on the scheduler `serve` runs.

For each of the first QUESTIONS MT-Bench questions (Spec-Bench's multi-turn category), in three
set-ups, each with its own scheduler and decoder (the 1.5B's default: the 0.5B drafting): `none`
(no prefix cache anywhere, the draft model's `prefix_cache=0`), `target` (`serve`'s prefix cache
for the target, none for the draft model) and `both` (the target's and the draft model's, the
defaults). In each, the first turn is answered, then the second turn (the first, its answer, the
second user message, through the chat template) is sent and timed: its time to first token and
the whole request. The set-ups take turns in a rotating order question by question; every second
turn's output is checked equal to its prompt decoded alone.

    python chat_turns.py [QUESTIONS]
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from leapdecode.api import Decoder, encode_prompt
from leapdecode.bench.datasets import load_dataset
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.engine.prefix_cache import PrefixCache
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission
from leapdecode.methods import backend_for
from leapdecode.models import load_model

NEW_TOKENS = 128
MAX_ROWS = 128
SETUPS = ("none", "target", "both")


def request(scheduler: BatchScheduler, decoder: Decoder, prompt: list[int]) -> tuple[list[int], float, float, int]:
    """One request alone on `scheduler`: its tokens, seconds to its first token and to its end,
    and the prompt tokens the target's prefix cache held."""
    tokens: list[int] = []
    ends: list[str] = []
    first: list[float] = []
    start = time.perf_counter()

    def on_step(step) -> None:
        if not first:
            first.append(time.perf_counter() - start)
        tokens.extend(step.tokens)

    submission = scheduler.submit(Submission(decoder.start(prompt, max_new_tokens=NEW_TOKENS), on_step, ends.append))
    while not ends:
        scheduler.step()
    return tokens, first[0], time.perf_counter() - start, submission.cached_tokens


def main() -> None:
    torch.set_num_threads(2)
    questions = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    lm = load_model("qwen2.5-coder-1.5b", log=lambda message: None)
    default = Decoder(lm)
    uncached = Decoder(lm, dataclasses.replace(default.method, prefix_cache=0))
    print(f"method: {default.method}", flush=True)
    cost = measure_batch_cost(backend_for(lm), MAX_ROWS, 8)
    turns = [p for p in load_dataset("spec-bench:multi-turn", 2 * questions) if p.earlier]
    default.generate(encode_prompt(lm, "Hello"), max_new_tokens=8)  # warm
    print(
        "| question | prompt | cached | "
        + " | ".join(f"first token, {s} s" for s in SETUPS)
        + " | "
        + " | ".join(f"request, {s} s" for s in SETUPS)
        + " |\n|---|---:|---:|"
        + "---:|" * (2 * len(SETUPS)),
        flush=True,
    )
    sums = {s: [0.0, 0.0] for s in SETUPS}
    for index, turn in enumerate(turns):
        first_turn = [{"role": "user", "content": turn.earlier[0]}]
        runs = {}
        prompt: list[int] = []
        for setup in SETUPS[index % 3 :] + SETUPS[: index % 3]:
            decoder = uncached if setup != "both" else default
            scheduler = BatchScheduler(
                decoder.backend, cost, max_batch=8, prefix_cache=PrefixCache(8192) if setup != "none" else None
            )
            answer, _, _, _ = request(scheduler, decoder, encode_prompt(lm, first_turn))
            messages = [
                *first_turn,
                {"role": "assistant", "content": lm.tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": turn.text},
            ]
            prompt = encode_prompt(lm, messages)
            runs[setup] = request(scheduler, decoder, prompt)
        alone = uncached.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids
        assert all(r[0] == alone for r in runs.values()), turn.id
        for setup in SETUPS:
            sums[setup][0] += runs[setup][1]
            sums[setup][1] += runs[setup][2]
        print(
            f"| {turn.id} | {len(prompt)} | {runs['target'][3]} | "
            + " | ".join(f"{runs[s][1]:.2f}" for s in SETUPS)
            + " | "
            + " | ".join(f"{runs[s][2]:.2f}" for s in SETUPS)
            + " |",
            flush=True,
        )
    print(
        "| all | | | "
        + " | ".join(f"{sums[s][0]:.2f}" for s in SETUPS)
        + " | "
        + " | ".join(f"{sums[s][1]:.2f}" for s in SETUPS)
        + " |"
    )
    for setup in SETUPS[1:]:
        print(
            f"{setup}: first token {sums['none'][0] / sums[setup][0]:.2f}x sooner, "
            f"whole request {sums['none'][1] / sums[setup][1]:.2f}x sooner"
        )


if __name__ == "__main__":
    main()
