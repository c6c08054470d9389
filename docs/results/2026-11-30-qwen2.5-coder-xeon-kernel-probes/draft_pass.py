"""The 0.5B's one-token pass on its draft path (int4 rounded for drafting, the 32,768-token draft
vocabulary, the lean forward), as `draft:model=qwen2.5-coder-0.5b` builds it for the 1.5B, after
300 cached tokens, in a loop: its median, and a steady loop to profile (`perf record --delay`
past the load, which the script prints).

    python draft_pass.py [THREADS] [PASSES]
"""

from __future__ import annotations

import statistics
import sys
import time

START = time.perf_counter()  # before the imports below: the load is timed from here

import torch  # noqa: E402

from leapdecode.bench.probes import CONTEXT, draft_path  # noqa: E402


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    passes = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    _, backend = draft_path()
    print(f"{type(backend).__name__} ready at {time.perf_counter() - START:.1f} s", flush=True)
    seconds = []
    with torch.inference_mode():
        seq, _ = backend.prefill(CONTEXT)
        for _ in range(5):
            backend.forward(seq, [1234])
            backend.rollback(seq, len(CONTEXT))
        for _ in range(passes):
            start = time.perf_counter()
            backend.forward(seq, [1234])
            seconds.append(time.perf_counter() - start)
            backend.rollback(seq, len(CONTEXT))
    print(f"draft pass: median {statistics.median(seconds) * 1e3:.2f} ms, best {min(seconds) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
