#!/usr/bin/env python
"""Prefill ms per prompt token through the decode loop's backend (TorchBackend.prefill), 1.5B int4."""

import statistics
import time

import torch

from leapdecode.engine.backend import TorchBackend
from leapdecode.models import load_model

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
backend = TorchBackend(lm.model, lm.exact_tokens)
for n in (256, 1024):
    ids = torch.randint(100, 20000, (n,)).tolist()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        with torch.inference_mode():
            backend.prefill(ids)
        ts.append(time.perf_counter() - t)
    m = statistics.median(ts)
    print(f"prefill {n} tokens: {m:.2f} s, {m / n * 1000:.2f} ms a token ({[round(x, 2) for x in ts]})", flush=True)
