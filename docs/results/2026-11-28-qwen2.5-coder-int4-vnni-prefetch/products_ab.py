"""The 1.5B int4's products (every quantized layer of a pass, in the pass's order: each layer's
fused query/key/value, output, fused gate/up and down projections, then the output layer) with
this tree's kernel against a base commit's, alternating in one process, and the machine's read
rate in each round: this machine's memory runs in two states (about 75 and 45 GB/s for a float32
sum) that change within minutes, and a kernel can rank differently in each.

    python products_ab.py BASE_COMMIT [ROWS, e.g. 1,2,3,4,6,8,16]

Prints a markdown table: per row count, the median of 15 rounds for each side, their ratio, the
median read rate of those rounds, and whether the outputs are bitwise the same.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from leapdecode.bench.ab import extension_at
from leapdecode.engine.backend import TorchBackend
from leapdecode.models import load_model
from leapdecode.models.quantize import QuantizedLinear, kernel

ROUNDS = 15


def run(module: Any, order: list[tuple[QuantizedLinear, ...]], xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Every product of a pass, one call each (a fused slot's layers in one call, as the lean forward runs them)."""
    return [
        module.quantized_linears(
            xs[group[0].in_features],
            [g.packed for g in group],
            [g.bits for g in group],
            [int(g.super_blocks) for g in group],
            [g.out_features for g in group],
            [g.bias for g in group],
            group[0].isa,
        )
        for group in order
    ]


def main() -> None:
    torch.set_num_threads(2)
    modules = {"base": extension_at(sys.argv[1], "quant.cpp"), "this tree": kernel()}
    lm = load_model("qwen2.5-coder-1.5b", log=lambda message: None)
    lean = TorchBackend(lm.model, exact_tokens=lm.exact_tokens).lean
    assert lean is not None
    order: list[tuple[QuantizedLinear, ...]] = []
    for layer in lean.layers:
        order += [layer.attention_in, (layer.o,), layer.mlp_in, (layer.down,)]
    order.append((lm.model.get_output_embeddings(),))
    data = torch.ones(2**27)
    print(f"| rows | {sys.argv[1][:8]}, ms | this tree, ms | ratio | read rate, GB/s | same outputs |")
    print("|---:|---:|---:|---:|---:|---|")
    with torch.inference_mode():
        for rows in [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else (1, 2, 3, 4, 6, 8, 16):
            xs = {k: torch.randn(rows, k) for k in {group[0].in_features for group in order}}
            times: dict[str, list[float]] = {name: [] for name in modules}
            rates = []
            for _ in range(ROUNDS):
                for name, module in modules.items():
                    start = time.perf_counter()
                    run(module, order, xs)
                    times[name].append(time.perf_counter() - start)
                start = time.perf_counter()
                data.sum()
                rates.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
            outputs = [run(module, order, xs) for module in modules.values()]
            same = all(torch.equal(a, b) for a, b in zip(*outputs))
            base, new = (statistics.median(times[name]) * 1e3 for name in modules)
            rate = statistics.median(rates)
            print(f"| {rows} | {base:.1f} | {new:.1f} | {new / base:.3f} | {rate:.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
