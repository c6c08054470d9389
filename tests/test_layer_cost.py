"""The per-kind split of a quantized pass: kinds found in a model, and the table's sums."""

from __future__ import annotations

import torch
from torch import nn

from leapdecode.bench.forward_cost import ForwardCost
from leapdecode.bench.layer_cost import LayerCost, LayerKind, layer_kinds, layers_markdown, measure_layers
from leapdecode.models.quantize import QuantizedLinear


def test_layers_are_grouped_by_bits_and_shape_with_their_bytes() -> None:
    model = nn.Sequential(
        QuantizedLinear.from_weight(torch.randn(64, 32), 4),
        QuantizedLinear.from_weight(torch.randn(64, 32), 4),
        QuantizedLinear.from_weight(torch.randn(32, 64), 8),
        nn.Linear(32, 32),
    )
    kinds = layer_kinds(model)
    assert [(k.bits, k.super_blocks, k.in_features, k.out_features, k.count) for k in kinds] == [
        (4, True, 32, 64, 2),
        (8, True, 64, 32, 1),
    ]
    four = next(iter(kinds))
    assert four.nbytes == model[0].packed.numel() + model[1].packed.numel() and four.macs(3) == 3 * 32 * 64 * 2
    costs = measure_layers(model, [1, 2], repeats=1)
    assert [(c.kind.bits, c.rows) for c in costs] == [(4, 1), (8, 1), (4, 2), (8, 2)] and all(c.ms > 0 for c in costs)


def test_the_table_sets_the_products_beside_the_pass_and_the_rest_is_the_difference() -> None:
    a, b = LayerKind(4, True, 1000, 2000, 10, 11_000_000), LayerKind(6, True, 2000, 1000, 5, 8_000_000)
    costs = [LayerCost(a, 1, 2.0), LayerCost(b, 1, 1.0), LayerCost(a, 8, 4.0), LayerCost(b, 8, 2.0)]
    passes = [ForwardCost(1, 5.0, 1.0), ForwardCost(8, 9.0, 1.8)]
    table = layers_markdown(costs, passes, "title")
    assert "| layers | MB | 1 row | 8 rows |" in table
    # 11 MB in 2 ms; 160 M multiply-adds in 4 ms
    assert "| 4-bit 1000→2000 ×10 | 11 | 2.0 (6 GB/s) | 4.0 (40 G/s) |" in table
    assert "| all products | 19 | 3.0 (6 GB/s) | 6.0 (40 G/s) |" in table  # 19 MB in 3 ms; 240 M in 6 ms
    assert "| whole pass | | 5.0 | 9.0 |" in table
    assert table.endswith("| 2.0 | 3.0 |")  # the rest: 5 - 3 and 9 - 6
