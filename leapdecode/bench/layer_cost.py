"""Where a pass of a quantized model goes: its linear layers' products, kind by kind, and the rest.

A pass of a quantized model is its linear layers' products over packed 4-, 6- and 8-bit blocks
(`models.quantize`) and the rest: attention, norms, rotary, element-wise work and Python. Per kind
of layer (bits, packing and shape), this times all the model's layers of that kind one after
another, each on its own weights (so they stream from memory as they do in a pass), at each row
count, and sets their sum beside a whole pass of as many rows: the rest is the difference. The
kinds are the model's own layers, each called on its own; the lean forward fuses some (q, k and v;
gate and up) and runs a chain's layers in one call, so the rest also holds what that saves. Each
kind's bytes and multiply-adds turn its time into GB/s and G multiply-adds a second, the two
figures to hold against the machine's limits (its memory bandwidth for one row, its integer
dot-product peak for many).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from leapdecode.bench.forward_cost import ForwardCost
from leapdecode.models.quantize import QuantizedLinear


@dataclass(frozen=True)
class LayerKind:
    """The model's quantized layers of one precision and shape."""

    bits: int
    super_blocks: bool  # the packed form of the scales (`QuantizedLinear.super_blocks`)
    in_features: int
    out_features: int
    count: int  # layers of this kind in the model
    nbytes: int  # their packed weights, all together

    @property
    def label(self) -> str:
        """The kind as the table names it."""
        return f"{self.bits}-bit {self.in_features}→{self.out_features} ×{self.count}"

    def macs(self, rows: int) -> int:
        """Multiply-adds of `rows` rows through all the layers of this kind."""
        return rows * self.in_features * self.out_features * self.count


@dataclass(frozen=True)
class LayerCost:
    """All the layers of one kind, run one after another over `rows` rows."""

    kind: LayerKind
    rows: int
    ms: float  # median wall time

    @property
    def gmacs(self) -> float:
        """G multiply-adds a second."""
        return self.kind.macs(self.rows) / self.ms / 1e6

    @property
    def gbps(self) -> float:
        """GB of weights streamed a second."""
        return self.kind.nbytes / self.ms / 1e6


def layer_kinds(model: nn.Module) -> dict[LayerKind, list[QuantizedLinear]]:
    """The model's quantized layers grouped by kind, in the order the model first holds each."""
    groups: dict[tuple[int, bool, int, int], list[QuantizedLinear]] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            key = (module.bits, module.super_blocks, module.in_features, module.out_features)
            groups.setdefault(key, []).append(module)
    return {
        LayerKind(bits, super_blocks, n_in, n_out, len(layers), sum(layer.packed.numel() for layer in layers)): layers
        for (bits, super_blocks, n_in, n_out), layers in groups.items()
    }


def measure_layers(model: nn.Module, sizes: Sequence[int], repeats: int = 5) -> list[LayerCost]:
    """Each kind's time at each row count (median of `repeats`, after one warm-up)."""
    kinds = layer_kinds(model)
    generator = torch.Generator().manual_seed(0)
    out: list[LayerCost] = []
    with torch.inference_mode():
        for rows in sizes:
            for kind, layers in kinds.items():
                x = torch.randn(rows, kind.in_features, generator=generator)  # [rows, in]
                times = []
                for _ in range(repeats + 1):
                    start = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    times.append(time.perf_counter() - start)
                out.append(LayerCost(kind, rows, statistics.median(times[1:]) * 1000))
    return out


def layers_markdown(costs: Sequence[LayerCost], passes: Sequence[ForwardCost], title: str) -> str:
    """A table: a line per kind, then all products, a whole pass and the rest; a column per row
    count, each cell ms with G multiply-adds a second (and GB/s at one row)."""
    sizes = sorted({cost.rows for cost in costs})
    kinds = list(dict.fromkeys(cost.kind for cost in costs))
    by = {(cost.kind, cost.rows): cost for cost in costs}
    whole = {p.tokens: p.ms for p in passes}
    lines = [
        title,
        "",
        "| layers | MB | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in sizes) + " |",
        "|---|---:|" + "---:|" * len(sizes),
    ]
    for kind in kinds:
        cells = []
        for n in sizes:
            cost = by[(kind, n)]
            rate = f"{cost.gbps:.0f} GB/s" if n == 1 else f"{cost.gmacs:.0f} G/s"
            cells.append(f"{cost.ms:.1f} ({rate})")
        lines.append(f"| {kind.label} | {kind.nbytes / 1e6:.0f} | " + " | ".join(cells) + " |")
    products = {n: sum(by[(kind, n)].ms for kind in kinds) for n in sizes}
    macs = {n: sum(kind.macs(n) for kind in kinds) for n in sizes}
    total_mb = sum(kind.nbytes for kind in kinds) / 1e6
    rates = {
        n: f"{total_mb / products[n]:.0f} GB/s" if n == 1 else f"{macs[n] / products[n] / 1e6:.0f} G/s" for n in sizes
    }
    lines.append(
        f"| all products | {total_mb:.0f} | " + " | ".join(f"{products[n]:.1f} ({rates[n]})" for n in sizes) + " |"
    )
    lines.append("| whole pass | | " + " | ".join(f"{whole[n]:.1f}" if n in whole else "–" for n in sizes) + " |")
    lines.append(
        "| rest (attention, norms, element-wise, Python) | | "
        + " | ".join(f"{whole[n] - products[n]:.1f}" if n in whole else "–" for n in sizes)
        + " |"
    )
    return "\n".join(lines)
