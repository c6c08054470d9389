"""G int8 multiply-adds a second of each kind of the 1.5B int4's quantized layers (the first layer
of each shape and bit width), at row counts from a shared pass to a prefill, median of 5 calls.

    python prefill_products.py [ROWS, e.g. 16,64,128,256,512]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from leapdecode.models import load_model
from leapdecode.models.quantize import QuantizedLinear


def rate(layer: QuantizedLinear, rows: int) -> float:
    x = torch.randn(rows, layer.in_features)  # [rows, K]
    layer(x)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return rows * layer.in_features * layer.out_features / statistics.median(times) / 1e9


def main() -> None:
    torch.set_num_threads(2)
    rows = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 64, 128, 256, 512]
    model = load_model("qwen2.5-coder-1.5b", log=lambda message: None).model
    kinds: dict[tuple[int, int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            kinds.setdefault((module.in_features, module.out_features, module.bits), name)
    print("| layer | K x N, bits | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|---|" + "---:|" * len(rows))
    with torch.inference_mode():
        for (k, n, bits), name in kinds.items():
            layer = model.get_submodule(name)
            rates = " | ".join(f"{rate(layer, m):.0f}" for m in rows)
            print(f"| `{name}` | {k} x {n}, {bits} | {rates} |", flush=True)


if __name__ == "__main__":
    main()
