"""A packed pass against passes of one sequence (qwen2.5-coder-1.5b int4, 2 threads): medians of 15."""

import statistics
import time

import torch

from leapdecode import load_model
from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.methods import backend_for

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
b = backend_for(lm)
V = b.vocab_size


def ctx(s, n):
    return [(1009 * i + 17 + s) % V for i in range(n)]


def med(f, reps=15):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000


def solo(seqs, context, n):
    def f():
        b.forward(seqs[0], ctx(99, n))
        b.rollback(seqs[0], context)

    return f


def packed(seqs, context, k, n):
    def f():
        forward_batch(b, [BatchItem(seqs[i], ctx(99 + i, n)) for i in range(k)])
        for i in range(k):
            b.rollback(seqs[i], context)

    return f


for context in (128, 1024):
    seqs = [b.prefill(ctx(s, context))[0] for s in range(8)]
    with torch.inference_mode():
        one = {n: med(solo(seqs, context, n)) for n in (1, 8, 16)}
        shared = {(k, n): med(packed(seqs, context, k, n)) for k, n in ((1, 1), (8, 1), (8, 2), (4, 4))}
        print(
            f"context {context}: one sequence 1 row {one[1]:.1f} ms, 8 rows {one[8]:.1f} ms, 16 rows {one[16]:.1f} ms; "
            f"packed 1x1 {shared[1, 1]:.1f} ms, 8x1 {shared[8, 1]:.1f} ms, 8x2 {shared[8, 2]:.1f} ms, "
            f"4x4 {shared[4, 4]:.1f} ms"
        )
