"""Prefill ms a prompt token of qwen2.5-coder-1.5b (int4) by the size of the chunks a prompt is taken in.

Usage: python prefill_chunks.py CHUNKS LENGTHS, e.g. `32,64,128,256 256,1024`. For each prompt
length, every chunk size in turn (interleaved, 3 rounds, median): the backend's prefill chunk is
set to the size, the prompt prefilled, the time divided by its tokens. Every size must give the
same logits (the kernels are row-exact), which is checked.
"""

import statistics
import sys
import time

import torch

import leapdecode


def main() -> None:
    torch.set_num_threads(2)
    backend = leapdecode.wrap(leapdecode.load_model("qwen2.5-coder-1.5b"), "ar").backend
    sizes = [int(s) for s in sys.argv[1].split(",")]
    lengths = [int(s) for s in sys.argv[2].split(",")]
    kind = type(backend)
    for length in lengths:
        prompt = [(1009 * i + 17) % backend.vocab_size for i in range(length)]
        backend.prefill(prompt[:64])  # warm-up
        runs: dict[int, list[float]] = {size: [] for size in sizes}
        first = None
        for _ in range(3):
            for size in sizes:
                kind.prefill_chunk = property(lambda self, size=size: size)
                start = time.perf_counter()
                _, scores = backend.prefill(prompt)
                runs[size].append(time.perf_counter() - start)
                first = scores.logits if first is None else first
                assert torch.equal(first, scores.logits), f"chunks of {size} changed the logits"
        cells = " ".join(f"{size}: {statistics.median(r) / length * 1e3:.2f} ms/token" for size, r in runs.items())
        print(length, cells, flush=True)


if __name__ == "__main__":
    main()
