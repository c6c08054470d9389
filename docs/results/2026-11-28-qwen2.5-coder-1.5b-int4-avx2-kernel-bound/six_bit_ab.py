"""6-bit (Q6_K) layers on the AVX2 path: this tree's kernel against a base commit's, on the same
packed weights, alternating (median of 9), each output checked bitwise equal first.

    python six_bit_ab.py BASE_COMMIT [THREADS]

Shapes: the 1.5B's down projection (8,960 inputs, 1,536 outputs) and a slice of its output layer
(1,536 inputs, 8,192 outputs), several copies each so that the weights come from memory.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from leapdecode.models.quantize import QuantizedLinear, SuperScales, kernel

AVX2 = 1  # the kernel's path argument


def base_module(commit: str) -> object:
    """The quantized kernel as `commit` had it."""
    folder = Path(tempfile.mkdtemp())
    for name in ("quant.cpp", "simd.h"):
        text = subprocess.run(
            ["git", "show", f"{commit}:leapdecode/models/{name}"], check=True, capture_output=True, text=True
        ).stdout
        (folder / name).write_text(text)
    return load(
        name=f"leapdecode_quant_{commit[:8]}",
        sources=[str(folder / "quant.cpp")],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


def six_bit_layer(n: int, k: int, g: torch.Generator) -> QuantizedLinear:
    q = torch.randint(0, 64, (n, k), generator=g).to(torch.uint8)
    sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    factors = SuperScales(torch.rand(n, -(-k // 256), generator=g) * 0.01, sc, per_group=2)
    return QuantizedLinear.from_groups(q, factors, None, 6, None)


def main() -> None:
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    modules = {sys.argv[1][:8]: base_module(sys.argv[1]), "this tree": kernel()}
    g = torch.Generator().manual_seed(0)
    shapes = {"down 8,960 → 1,536": (1536, 8960, 6), "head slice 1,536 → 8,192": (8192, 1536, 4)}
    names = " | ".join(f"{name}, ms" for name in modules)
    print(f"| layer | rows | {names} | ratio | G multiply-adds/s (this tree) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (n, k, copies) in shapes.items():
        layers = [six_bit_layer(n, k, g) for _ in range(copies)]
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, k)
            outputs = [m.quantized_linear(x, layers[0].packed, 6, True, n, None, AVX2) for m in modules.values()]  # type: ignore[attr-defined]
            assert torch.equal(outputs[0], outputs[1]), "the two kernels disagree"
            times: dict[str, list[float]] = {name: [] for name in modules}
            for _ in range(9):
                for name, module in modules.items():
                    start = time.perf_counter()
                    for layer in layers:
                        module.quantized_linear(x, layer.packed, 6, True, n, None, AVX2)  # type: ignore[attr-defined]
                    times[name].append((time.perf_counter() - start) / copies)
            base, new = (sorted(t)[4] for t in times.values())
            rate = rows * n * k / new / 1e9
            print(f"| {label} | {rows} | {base * 1e3:.2f} | {new * 1e3:.2f} | {new / base:.2f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
