"""Plain decoding, `anpd`, `suffix` and the draft model (the 1.5B's default) on the chat load of
`bench --concurrency` (4 prompts each of Spec-Bench's multi-turn, translation, QA and math, 96 new
tokens), one request at a time, the methods taking turns prompt by prompt in one process, so a
machine whose speed drifts between runs times them all in the same state. Every output is
checked equal to plain decoding's.

    python methods_ab.py [ROUNDS]
"""

from __future__ import annotations

import sys
import time

import torch

from leapdecode.api import Decoder
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.models import load_model

CATEGORIES = ("multi-turn", "translation", "qa", "math_reasoning")
METHODS = ("ar", "anpd", "suffix", "draft:model=qwen2.5-coder-0.5b")


def main() -> None:
    torch.set_num_threads(2)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    lm = load_model("qwen2.5-coder-1.5b", log=lambda message: None)
    plain = Decoder(lm, "ar")
    prompts = {
        c: [
            encode_turns(lm, p, lambda ids: plain.generate(ids, max_new_tokens=96).token_ids)
            for p in load_dataset(f"spec-bench:{c}", 4)
        ]
        for c in CATEGORIES
    }
    decoders = {m: plain if m == "ar" else Decoder(lm, m) for m in METHODS}
    for decoder in decoders.values():
        decoder.generate(prompts[CATEGORIES[0]][0], max_new_tokens=8)
    seconds = {(c, m): 0.0 for c in CATEGORIES for m in METHODS}
    tokens = dict.fromkeys(METHODS, 0)
    for round_ in range(rounds):
        for category, group in prompts.items():
            for prompt in group:
                reference = None
                for method, decoder in decoders.items():
                    start = time.perf_counter()
                    out = decoder.generate(prompt, max_new_tokens=96).token_ids
                    seconds[(category, method)] += time.perf_counter() - start
                    reference = out if reference is None else reference
                    assert out == reference, (method, category)
                    tokens[method] += len(out)
        total = {m: sum(seconds[(c, m)] for c in CATEGORIES) for m in METHODS}
        rates = ", ".join(f"{m} {tokens[m] / total[m]:.1f} tok/s ({total['ar'] / total[m]:.2f}x)" for m in METHODS)
        print(f"after round {round_ + 1}: {rates}", flush=True)
    print("\n| category | " + " | ".join(f"`{m}`" for m in METHODS) + " |\n|---|" + "---:|" * len(METHODS))
    for c in CATEGORIES:
        print(f"| {c} | " + " | ".join(f"{seconds[(c, 'ar')] / seconds[(c, m)]:.2f}x" for m in METHODS) + " |")


if __name__ == "__main__":
    main()
