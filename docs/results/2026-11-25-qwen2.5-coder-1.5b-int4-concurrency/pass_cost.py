"""A packed pass against passes of one sequence (qwen2.5-coder-1.5b int4, 2 threads): medians of 15."""
import statistics, time, torch
from leapdecode import load_model
from leapdecode.methods import backend_for
from leapdecode.engine.batch import BatchItem, forward_batch
torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
b = backend_for(lm)
V = b.vocab_size
def ctx(s, n): return [(1009 * i + 17 + s) % V for i in range(n)]
def med(f, reps=15):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000
for context in (128, 1024):
    seqs = [b.prefill(ctx(s, context))[0] for s in range(8)]
    def solo(n):
        def f():
            b.forward(seqs[0], ctx(99, n)); b.rollback(seqs[0], context)
        return f
    def packed(k, n):
        def f():
            forward_batch(b, [BatchItem(seqs[i], ctx(99 + i, n)) for i in range(k)])
            for i in range(k): b.rollback(seqs[i], context)
        return f
    with torch.inference_mode():
        print(f"context {context}: one sequence 1 row {med(solo(1)):.1f} ms, 8 rows {med(solo(8)):.1f} ms, 16 rows {med(solo(16)):.1f} ms; "
              f"packed 1x1 {med(packed(1, 1)):.1f} ms, 8x1 {med(packed(8, 1)):.1f} ms, 8x2 {med(packed(8, 2)):.1f} ms, 4x4 {med(packed(4, 4)):.1f} ms")
