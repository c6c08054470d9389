"""The row-exact attention kernel with this tree's code against a base commit's, alternating in one
process: the 1.5B's shape (12 query heads over 2 key/value heads of 128), chains of 1-16 rows
after 300 and 1,000 cached tokens, median of 15 rounds of 40 calls, and whether the outputs are
bitwise the same.

    python attention_ab.py BASE_COMMIT
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from leapdecode.bench.ab import extension_at
from leapdecode.models import row_exact

HEADS, KV_HEADS, DIM = 12, 2, 128


def main() -> None:
    torch.set_num_threads(2)
    kernels = {"base": extension_at(sys.argv[1], "row_exact.cpp"), "this tree": row_exact.kernel()}
    scale = DIM**-0.5
    print(f"| cached | rows | {sys.argv[1][:8]}, us | this tree, us | ratio | same |")
    print("|---:|---:|---:|---:|---:|---|")
    for cached in (300, 1000):
        for rows in (1, 2, 3, 4, 8, 16):
            total = cached + rows
            q = torch.randn(1, HEADS, rows, DIM)
            k, v = torch.randn(1, KV_HEADS, total, DIM), torch.randn(1, KV_HEADS, total, DIM)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(15):
                for name, module in kernels.items():
                    start = time.perf_counter()
                    for _ in range(40):
                        module.row_exact_attention(q, k, v, None, scale, False)
                    times[name].append((time.perf_counter() - start) / 40)
            outs = [module.row_exact_attention(q, k, v, None, scale, False) for module in kernels.values()]
            base, new = (statistics.median(times[name]) * 1e6 for name in kernels)
            same = torch.equal(*outs)
            print(f"| {cached} | {rows} | {base:.0f} | {new:.0f} | {new / base:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
