"""What a small op costs right after a weight stream: an 8 MB sum (one thread) sweeps the caches,
then an RMS norm, the same norm again, a SiLU, a multiply, an add and a norm again, each timed
(median of 300). Usage: python cold_ops.py"""

import time

import numpy as np
import torch

from leapdecode.models import row_exact

torch.set_num_threads(2)
kernel = row_exact.kernel()
weight, x = torch.ones(896), torch.randn(1, 896)
sweep = np.ones(8 << 20, dtype=np.uint8)
clock = time.perf_counter
times: dict[str, list[float]] = {name: [] for name in ("norm", "norm again", "silu", "mul", "add", "norm, third")}
for _ in range(300):
    sweep.sum()
    t0 = clock()
    kernel.rms_norm(x, weight, 1e-6, False)
    t1 = clock()
    kernel.rms_norm(x, weight, 1e-6, False)
    t2 = clock()
    s = torch.nn.functional.silu(x)
    t3 = clock()
    m = s * x
    t4 = clock()
    a = m + x
    t5 = clock()
    kernel.rms_norm(a, weight, 1e-6, False)
    t6 = clock()
    for name, spent in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
        times[name].append(spent)
for name, spent in times.items():
    print(f"{name}: {1e6 * sorted(spent)[150]:.1f} us")
