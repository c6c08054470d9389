"""The 7B-shaped synthetic target (`make synthetic-7b`): plain decoding end to end, and the ratio c
of the 0.5B's draft pass (its draft path for this target: int4 rounded for drafting, the
32,768-token draft vocabulary, the lean forward) to this target's one-token pass, both after 300
cached tokens.

    python seven_b.py [PATH_TO_GGUF]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

import leapdecode
from leapdecode.methods import DraftModel
from leapdecode.models import load_model

CONTEXT = [1000 + (i * 37) % 20000 for i in range(300)]
DEFAULT = Path.home() / ".cache/leapdecode/synthetic/qwen2.5-7b-shapes-q4_k_m.gguf"


def one_token_ms(backend, passes: int = 20) -> float:
    seconds = []
    with torch.inference_mode():
        seq, _ = backend.prefill(CONTEXT)
        for i in range(passes + 3):
            start = time.perf_counter()
            backend.forward(seq, [1234])
            if i >= 3:
                seconds.append(time.perf_counter() - start)
            backend.rollback(seq, len(CONTEXT))
    return statistics.median(seconds) * 1e3


def main() -> None:
    torch.set_num_threads(2)
    quiet = lambda message: None  # noqa: E731
    target = load_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT, log=quiet)
    plain = leapdecode.wrap(target, "ar")
    plain.generate(CONTEXT[:32], max_new_tokens=4)  # warm
    for _ in range(2):  # timed from the first token (the prompt's prefill left out, as llama-bench's tg leaves it)
        steps = plain.stream(CONTEXT, max_new_tokens=33)
        first = next(steps)
        start, tokens = time.perf_counter(), 0
        for step in steps:
            tokens += len(step.tokens)
        seconds = time.perf_counter() - start
        print(f"plain decoding: {tokens} tokens after the first in {seconds:.2f} s, {tokens / seconds:.2f} tok/s")
        del first
    method = DraftModel(model="qwen2.5-coder-0.5b")
    draft = method.draft_backend(target, method.load_draft(target, quiet), quiet)
    from leapdecode.engine.backend import TorchBackend

    target_ms = one_token_ms(TorchBackend(target.model, exact_tokens=target.exact_tokens))
    draft_ms = one_token_ms(draft)
    print(f"target one-token pass {target_ms:.1f} ms, draft pass {draft_ms:.1f} ms, c = {draft_ms / target_ms:.3f}")


if __name__ == "__main__":
    main()
