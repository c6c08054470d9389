"""Per step of the draft path, which plan drafted (the suffix match: R, the draft model: M, or
nothing: -), how many tokens, how many were accepted, and the step's ms with the target's and
the draft model's backend time in it (this script's own instrumentation: it wraps the two
backend classes' forward and prefill and the drafter's update). The first step holds the
target's prefill. Usage: python step_choice.py DATASET@LIMIT METHOD..., e.g.
python step_choice.py humaneval@2 draft:model=qwen2.5-coder-0.5b"""

import sys
import time
from collections import defaultdict

import torch

from leapdecode import wrap
from leapdecode.bench.datasets import load_dataset
from leapdecode.drafters.draft_model import DraftModelDrafter
from leapdecode.engine.backend import TorchBackend
from leapdecode.engine.draft_head import DraftHeadBackend
from leapdecode.models import load_model

torch.set_num_threads(2)
spent: dict[str, float] = defaultdict(float)
steps: list[tuple[str, int, int, float, float, float]] = []
last = [time.perf_counter()]


def timed(cls: type, label: str) -> None:
    for name in ("forward", "prefill"):
        original = cls.__dict__.get(name) or getattr(cls, name)

        def wrapper(self, *args, _original=original, _key=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - start

        setattr(cls, name, wrapper)


def heard(self, tokens, num_accepted, _update=DraftModelDrafter.update):
    now = time.perf_counter()
    plan = "R" if self.retrieved else "M" if self.last_draft else "-"
    target = spent["target"] - spent["draft"]  # a draft call passes through both wrappers
    steps.append((plan, len(self.last_draft), num_accepted, now - last[0], target, spent["draft"]))
    spent.clear()
    last[0] = now
    return _update(self, tokens, num_accepted)


timed(DraftHeadBackend, "draft")
timed(TorchBackend, "target")
DraftModelDrafter.update = heard
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
dataset, limit = sys.argv[1].split("@")
prompts = load_dataset(dataset, int(limit))
for method in sys.argv[2:]:
    decoder = wrap(lm, method)
    decoder.generate([{"role": "user", "content": "hi"}], max_new_tokens=8, chat=True)  # warm
    for prompt in prompts:
        steps.clear()
        spent.clear()
        text = [{"role": "user", "content": prompt.text}] if prompt.chat else prompt.text
        start = last[0] = time.perf_counter()
        out = decoder.generate(text, max_new_tokens=128, chat=prompt.chat)
        print(f"{method} {prompt.id}: {time.perf_counter() - start:.2f} s, {out.stats.new_tokens} tokens")
        for plan, drafted, accepted, ms, target, draft in steps:
            print(
                f"  {plan} drafted {drafted:2d} accepted {accepted:2d}: {1000 * ms:5.0f} ms "
                f"(target {1000 * target:5.0f}, draft {1000 * draft:5.0f})"
            )
