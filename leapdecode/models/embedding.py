"""An input embedding kept in a quantized layer's packed records, de-quantized by row when read.

Why: a vocabulary of 150,000 tokens by 1,536 is 0.9 GB in float32, 0.19 GB as a GGUF's Q6_K
blocks, and a decoding step reads a handful of its rows. Kept as the file stores it (and, for a
tied output layer, as the very records that layer streams), each row read is de-quantized on the
spot: the same float32 values as de-quantizing the whole table first (`rounding.dequantize`).
"""

from __future__ import annotations

import torch
from torch import nn

from leapdecode.models.packing import BLOCK, unpack, unpack_super
from leapdecode.models.quantize import QuantizedLinear
from leapdecode.models.rounding import GROUP, dequantize


class QuantizedEmbedding(nn.Module):
    """An embedding table [vocab, hidden] held as `layer`'s packed records (shared with it, not copied)."""

    def __init__(self, layer: QuantizedLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        self.bits, self.super_blocks = layer.bits, layer.super_blocks
        self.num_embeddings, self.embedding_dim = layer.out_features, layer.in_features
        self.padding_idx = padding_idx
        self.register_buffer("packed", layer.packed)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The de-quantized rows `ids` [n] → [n, hidden] float32."""
        blocks, inverse = torch.unique(torch.div(ids, BLOCK, rounding_mode="floor"), return_inverse=True)
        records = self.packed[blocks]  # [u, bytes] (super-block form) or [u, groups, record]
        count = records.shape[0] * BLOCK
        if self.super_blocks:
            qweight, factors = unpack_super(records, self.bits, count, self.embedding_dim // GROUP)
            table = dequantize(qweight, factors.scales(), factors.mins(), self.bits)  # [u · 8, hidden]
        else:
            table = dequantize(*unpack(records, self.bits, count), self.bits)
        return table[inverse * BLOCK + ids % BLOCK]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        flat = self.rows(input_ids.reshape(-1))  # [n, hidden]
        return flat.reshape(*input_ids.shape, self.embedding_dim)

    def dequantized(self) -> torch.Tensor:
        """The whole de-quantized table [vocab, hidden] (for checks: the float table's memory). No
        `weight` attribute on purpose: code probing an embedding's weight would de-quantize it all."""
        return self.rows(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, super_blocks={self.super_blocks}"
