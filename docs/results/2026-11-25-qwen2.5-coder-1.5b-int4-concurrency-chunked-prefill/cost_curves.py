"""Cost curves of the 1.5B int4 (ms a pass by rows): one sequence (chains, trees) and packed passes
over 1, 2 and 8 sequences at 64 and 512 tokens of context; a 600-token prefill in chunks of 128 and
256."""

import statistics
import time

import torch

from leapdecode import load_model
from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.cost import measure_batch_cost, measure_forward_cost
from leapdecode.methods import backend_for

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
b = backend_for(lm)


def show(name, c, n=16):
    print(f"{name:28s}", " ".join(f"{1000 * c.of(i):6.1f}" for i in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)[:n]), flush=True)


print("rows:                       ", " ".join(f"{i:6d}" for i in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)))
show("solo chain ctx64", measure_forward_cost(b, 32, tree=False))
show("solo tree ctx64", measure_forward_cost(b, 32, tree=True))
for ctx in (64, 512):
    for s in (1, 2, 8):
        show(f"batch seqs={s} ctx{ctx}", measure_batch_cost(b, 32, s, context=ctx))
vocab = b.vocab_size
toks = [(1009 * i + 17) % vocab for i in range(600)]
for chunk in (128, 256):
    runs = []
    for _ in range(3):
        seq = b.new_sequence()
        t = time.perf_counter()
        for a in range(0, 600, chunk):
            forward_batch(b, [BatchItem(seq, toks[a : a + chunk], None, last_only=True)])
        runs.append(time.perf_counter() - t)
    print(f"prefill 600 in chunks of {chunk}: {statistics.median(runs):.2f} s", flush=True)
runs = []
for _ in range(3):
    t = time.perf_counter()
    b.prefill(toks)
    runs.append(time.perf_counter() - t)
print(f"backend.prefill 600: {statistics.median(runs):.2f} s")
