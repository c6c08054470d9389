"""What bounds the int4 kernel on this CPU: its rate by rows on one and two threads, with the
weights in cache and streamed from memory, and a one-row stream in one call or in layer-sized calls.

    python kernel_bound.py

Prints markdown tables. Every figure is the best of several rounds, the compared cases alternating
within a round (this machine's timings drift by up to a third between runs).
"""

from __future__ import annotations

import time

import torch

from leapdecode.models.quantize import QuantizedLinear, kernel

K, ROUNDS = 1536, 5


def read_bandwidth(threads: int) -> float:
    """Bytes a second `threads` threads read (a float32 sum over 1 GiB, best of 5)."""
    torch.set_num_threads(threads)
    data = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def rates(layers: list[QuantizedLinear], rows: int, calls: int) -> dict[int, float]:
    """Multiply-adds a second on 1 and 2 threads, `calls` calls cycling over `layers`."""
    x = torch.randn(rows, K)
    macs = rows * K * layers[0].out_features * calls
    best = {1: 0.0, 2: 0.0}
    for _ in range(ROUNDS):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for layer in layers:
                layer(x)
            start = time.perf_counter()
            for i in range(calls):
                layers[i % len(layers)](x)
            best[threads] = max(best[threads], macs / (time.perf_counter() - start))
    return best


def stream(module: object, packed: torch.Tensor, pieces: int) -> float:
    """Bytes a second of one-row products over `packed` in `pieces` calls (2 threads)."""
    torch.set_num_threads(2)
    per = packed.shape[0] // pieces
    views = [packed[i * per : (i + 1) * per] for i in range(pieces)]
    x = torch.randn(1, K)
    start = time.perf_counter()
    for view in views:
        module.quantized_linear(x, view, 4, True, per * 8, None, -1)  # type: ignore[attr-defined]
    return per * pieces * packed.shape[1] / (time.perf_counter() - start)


def main() -> None:
    print(f"read bandwidth: {read_bandwidth(1) / 1e9:.1f} GB/s on 1 thread, {read_bandwidth(2) / 1e9:.1f} on 2\n")
    cached = [QuantizedLinear.from_weight(torch.randn(512, K), 4)]  # 0.44 MB: stays in each core's L2
    streamed = [QuantizedLinear.from_weight(torch.randn(8960, K), 4) for _ in range(16)]  # 131 MB: memory
    print("| rows | in cache, 1 thread | 2 threads | 2 / 1 | from memory, 1 thread | 2 threads | 2 / 1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in (1, 4, 16, 64):
            c = rates(cached, rows, max(8, 2000 // rows))
            m = rates(streamed, rows, 16)
            print(
                f"| {rows} | {c[1] / 1e9:.0f} G/s | {c[2] / 1e9:.0f} G/s | {c[2] / c[1]:.2f} "
                f"| {m[1] / 1e9:.0f} G/s | {m[2] / 1e9:.0f} G/s | {m[2] / m[1]:.2f} |"
            )
        module = kernel()
        big = streamed[0].packed.repeat(128, 1)  # 1 GB of valid records
        del streamed
        print("\n| one row over 1 GB | one call | 128 calls of 8 MB | 512 calls of 2 MB |")
        print("|---|---:|---:|---:|")
        best = {1: 0.0, 128: 0.0, 512: 0.0}
        for _ in range(3):
            for pieces in best:
                best[pieces] = max(best[pieces], stream(module, big, pieces))
        print("| GB/s | " + " | ".join(f"{best[p] / 1e9:.1f}" for p in best) + " |")


if __name__ == "__main__":
    main()
