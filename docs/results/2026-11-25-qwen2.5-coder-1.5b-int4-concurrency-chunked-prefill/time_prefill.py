"""Median prefill time of a model (argv 2, dtype argv 3) for the first 150 and 600 tokens of a
source file, with the leapdecode checkout at argv 1."""

# The checkout under test goes first on the import path, before leapdecode is imported.
# ruff: noqa: E402
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch

from leapdecode import load_model
from leapdecode.methods import backend_for

torch.set_num_threads(2)
lm = load_model(sys.argv[2], log=lambda m: None, **({"dtype": sys.argv[3]} if len(sys.argv) > 3 else {}))
print(lm.describe)
backend = backend_for(lm)
text = open(sys.argv[1] + "/leapdecode/engine/scheduler.py").read()
ids = lm.tokenizer(text)["input_ids"]
for n in (150, 600):
    times = []
    for _ in range(3):
        t = time.perf_counter()
        backend.prefill(ids[:n])
        times.append(time.perf_counter() - t)
    print(n, "tokens:", " ".join(f"{x:.2f}" for x in times), "median", f"{statistics.median(times):.2f} s")
