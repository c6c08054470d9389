#!/usr/bin/env python
"""A/B in one process: packed weights in huge pages (as loaded) vs the same bytes in torch's own
allocation, per pass of R rows after 300 cached tokens; rounds alternate to cancel drift."""

import re
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from leapdecode.models import load_model
from leapdecode.models.quantize import QuantizedLinear

torch.set_num_threads(2)
name = sys.argv[1]
rows_list = [int(r) for r in sys.argv[2].split(",")]
lm = load_model(name, log=lambda m: None)
model = lm.model
layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
huge = [m.packed for m in layers]
plain = [m.packed.clone() for m in layers]
total = sum(b.numel() for b in huge)
print(
    name,
    "packed MB",
    round(total / 1e6, 1),
    "in layers >= 2 MiB:",
    round(sum(b.numel() for b in huge if b.numel() >= 2**21) / 1e6, 1),
    "AnonHugePages MB",
    int(re.search(r"AnonHugePages:\s+(\d+)", open("/proc/meminfo").read()).group(1)) // 1024,
)


def use(bufs):
    for m, b in zip(layers, bufs):
        m.packed = b


ids = torch.randint(0, 1000, (1, 300))


def pass_ms(rows, n=11):
    with torch.inference_mode():
        c = DynamicCache(config=model.config)
        model(ids, cache=c, use_cache=True)
        x = torch.randint(0, 1000, (1, rows))
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            model(x, cache=c, use_cache=True)
            ts.append(time.perf_counter() - t)
            c.crop(-rows)
    return statistics.median(ts) * 1000


for r in rows_list:
    a, b = [], []
    for _ in range(5):
        use(plain)
        a.append(pass_ms(r))
        use(huge)
        b.append(pass_ms(r))
    A, B = statistics.median(a), statistics.median(b)
    rounds = f"rounds plain {[round(v, 1) for v in a]}, huge {[round(v, 1) for v in b]}"
    print(f"rows {r:3d}: plain {A:6.1f} ms  huge pages {B:6.1f} ms  {A / B:.3f}x  ({rounds})", flush=True)
