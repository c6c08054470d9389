"""Per pass at 8 clients on the 1.5B int4: seconds in forward_batch against the whole step
(drafting, allocation, verification, callbacks), for ar and anpd, first turns of the bench prompts."""

import time

import torch

from leapdecode import load_model
from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.engine import scheduler as sched_mod
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
prompts = load_dataset("humaneval+spec-bench", "3,humaneval=10")
ids = [
    list(
        lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    for p in prompts
    if p.chat and not p.earlier
][:16]
cost = measure_batch_cost(backend_for(lm), 128, 8)
orig = sched_mod.forward_batch
spent = [0.0]


def timed(*a, **k):
    t = time.perf_counter()
    out = orig(*a, **k)
    spent[0] += time.perf_counter() - t
    return out


sched_mod.forward_batch = timed
for method in ("ar", "anpd"):
    decoder = Decoder(lm, method)
    spent[0] = 0.0
    t = time.perf_counter()
    result = run_concurrent(decoder, cost, ids, 96, 8, [[] for _ in ids], 128)
    total = time.perf_counter() - t
    print(
        method,
        f"total {total:.1f} s, forward {spent[0]:.1f} s, other {total - spent[0]:.1f} s",
        f"tok/s {result.new_tokens / result.wall_s:.1f}, passes {result.passes}",
    )
