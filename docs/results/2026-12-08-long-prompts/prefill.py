#!/usr/bin/env python
"""Prefill ms per prompt token at 512 / 2,048 / 4,096 / 8,192 tokens through the decode loop's
backend (`TorchBackend.prefill`, the 1.5B on its default path), each length's fastest of
interleaved rounds, and its growth over the first length's: what the attention over a longer
prompt adds per token.

    python docs/results/2026-12-08-long-prompts/prefill.py [--lengths 512,2048] [--repeats 2]
"""

import argparse
import json
import time

import torch

from leapdecode.engine.backend import TorchBackend
from leapdecode.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--lengths", default="512,2048,4096,8192")
parser.add_argument("--repeats", type=int, default=2)
parser.add_argument("--model", default="qwen2.5-coder-1.5b")
args = parser.parse_args()

torch.set_num_threads(2)
lm = load_model(args.model, log=lambda m: None)
backend = TorchBackend(lm.model, lm.exact_tokens)
lengths = [int(x) for x in args.lengths.split(",")]
times: dict[int, list[float]] = {n: [] for n in lengths}
for _ in range(args.repeats):  # rounds over every length: a slow minute lands on one round, not on one length
    for n in lengths:
        ids = [100 + (i * 7919) % 20000 for i in range(n)]
        for _ in range(3 if n <= 512 else 1):  # the base of every ratio: its fastest of more tries
            start = time.perf_counter()
            backend.prefill(ids)
            times[n].append(time.perf_counter() - start)
base = min(times[lengths[0]]) / lengths[0]
for n in lengths:
    per_token = min(times[n]) / n
    row = {
        "tokens": n,
        "ms_per_token": round(per_token * 1000, 3),
        "growth": round(per_token / base, 3),
        "seconds": [round(t, 2) for t in times[n]],
    }
    print(json.dumps(row), flush=True)
