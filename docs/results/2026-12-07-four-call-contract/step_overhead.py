"""Per-pass time of plain decoding, an uncut ANPD and Jacobi on a tiny random model (a forward of
about a millisecond): what the decode loop itself adds per pass, for the checkout on PYTHONPATH.

    PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python step_overhead.py   (run from that checkout)
"""

from __future__ import annotations

import statistics
import time

import torch

from leapdecode import wrap
from tests.helpers import make_tiny_model, tiny_lm


def main() -> None:
    torch.set_num_threads(1)
    lm = tiny_lm(make_tiny_model("llama", layers=2))
    prompt = [(7 * i + 3) % 90 + 4 for i in range(32)]
    for method in ("ar", "anpd:cost_aware=false", "jacobi"):
        decoder = wrap(lm, method)
        decoder.generate(prompt, max_new_tokens=32)  # warm-up
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            out = decoder.generate(prompt, max_new_tokens=400)
            runs.append((time.perf_counter() - start) / out.stats.forward_passes)
        print(f"{method:24s} {1e6 * statistics.median(runs):8.1f} us per pass ({out.stats.forward_passes} passes)")


if __name__ == "__main__":
    main()
