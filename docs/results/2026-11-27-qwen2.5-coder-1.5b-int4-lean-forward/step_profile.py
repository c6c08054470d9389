"""Where a step of the draft path goes, in ms: the target's passes, the draft model's passes and
the rest, on Spec-Bench prompts of one category (greedy, 128 new tokens), beside plain decoding.
Times each backend call by wrapping the two backend classes' forward and prefill (this script's
own instrumentation). Usage: python step_profile.py CATEGORY [LIMIT]"""

import sys
import time
from collections import defaultdict

import torch

from leapdecode import wrap
from leapdecode.bench.datasets import load_dataset
from leapdecode.engine.backend import TorchBackend
from leapdecode.engine.draft_head import DraftHeadBackend
from leapdecode.models import load_model

torch.set_num_threads(2)
category, limit = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(cls: type, label: str) -> None:
    for name in ("forward", "prefill"):
        original = cls.__dict__.get(name) or getattr(cls, name)

        def wrapper(self, *args, _original=original, _key=f"{label} {name}", **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - start
                calls[_key] += 1

        setattr(cls, name, wrapper)


timed(DraftHeadBackend, "draft")
timed(TorchBackend, "target")  # DraftHeadBackend's own wrappers were set first
prompts = [[{"role": "user", "content": p.text}] for p in load_dataset(f"spec-bench:{category}", limit)]
for method in ("ar", "draft:model=qwen2.5-coder-0.5b"):
    decoder = wrap(lm, method)
    decoder.generate(prompts[0], max_new_tokens=16, chat=True)  # warm
    spent.clear()
    calls.clear()
    total, steps, tokens = 0.0, 0, 0
    for ids in prompts:
        start = time.perf_counter()
        out = decoder.generate(ids, max_new_tokens=128, chat=True)
        total += time.perf_counter() - start
        steps += out.stats.forward_passes - 1
        tokens += out.stats.new_tokens
    print(
        f"\n{method}: {tokens} tokens, {steps} steps, {1000 * total / steps:.1f} ms a step, {tokens / total:.1f} tok/s"
    )
    for key in sorted(spent):
        print(
            f"  {key}: {calls[key]} calls, {1000 * spent[key] / calls[key]:.1f} ms a call, "
            f"{1000 * spent[key] / steps:.1f} ms a step"
        )
    other = total - sum(spent.values())
    print(f"  rest: {1000 * other / steps:.1f} ms a step")
