"""A GGUF file's own quantized blocks, as group-quantized layers (`leapdecode.models.quantize`).

A GGUF source is loaded into PyTorch de-quantized (by `transformers`, through gguf-py); rounding
those floats again would make a second model. Instead, for every weight stored in a layout that
fits ours, take the file's integers and scales themselves:
- Q4_0 (w = d·(q − 8)), Q4_1 (w = d·q + m) and Q4_K (w = d·sc·q − dmin·m per group of 32 inside
  a block of 256) → int4 groups with a scale and a minimum;
- Q8_0 (w = d·q) → int8 groups;
- Q5_0 (w = d·(q − 16)), IQ4_NL (w = d·k[q], k a table of 16 int8 values) and IQ4_XS (the same
  table, a 6-bit scale per 32 inside a block of 256: w = (d·(ls − 32))·k[q]) → int8 groups: the
  file's integers and scales, each group's scale one float32 (as gguf-py computes it);
- Q6_K (w = d·sc·(q − 32), an int8 sc per 16 weights) and Q3_K (w = d·(sc − 32)·q, q in −4..3, a
  6-bit sc per 16 weights) → 6-bit groups.
Q4_K's, Q6_K's and Q3_K's scales keep their own form, small integers times a float per 256
weights (the layers' super-block form, `rounding.SuperScales`): the same float32 values, in
fewer bytes. Other types (Q5_1, Q5_K, Q2_K and the IQ2/IQ3 families) fit no layout the kernel
has: `read_blocks` returns None for them. `packed_layer` turns a tensor's raw rows into a
layer a slice of rows at a time, so converting a large output layer holds one slice of
unpacked integers, not the whole matrix's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from leapdecode.models.packing import BLOCK, pack, pack_super, packed_shape
from leapdecode.models.quantize import QuantizedLinear, huge_page_empty
from leapdecode.models.rounding import GROUP, SuperScales, pack_int4


@dataclass(frozen=True)
class Blocks:
    """One weight's groups: q [rows, groups, 32] (int4: 0..15; 6 bits: 0..63; int8: −127..127), scales
    and mins [rows, groups] (mins None for int8 and 6 bits; 6 bits: scales per 16 weights, [rows, 2·groups])."""

    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    factors: SuperScales | None = None  # the scales' super-block form, where the file has it (Q4_K)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, mins) as `rounding.quantize_weight` gives them (what
        `QuantizedLinear.from_groups` takes)."""
        if self.bits == 4:
            return pack_int4(self.q.to(torch.uint8)), self.scales, self.mins
        if self.bits == 6:
            return self.q.to(torch.uint8).reshape(self.q.shape[0], -1), self.scales, None
        return self.q.to(torch.int8).reshape(self.q.shape[0], -1).view(torch.uint8), self.scales, None

    def layer(self, bias: torch.Tensor | None) -> QuantizedLinear:
        """A quantized layer of these groups (the super-block form where the file's scales have it)."""
        qweight, scales, mins = self.groups()
        return QuantizedLinear.from_groups(
            qweight, self.factors if self.factors is not None else scales, mins, self.bits, bias
        )

    def rows(self, index: torch.Tensor) -> Blocks:
        """The groups of the outputs `index` (a permutation)."""
        return Blocks(
            self.bits,
            self.q[index],
            self.scales[index],
            None if self.mins is None else self.mins[index],
            None if self.factors is None else self.factors.rows(index),
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


# IQ4_NL's and IQ4_XS's sixteen levels (ggml's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
# The block types `read_blocks` takes as they are, and the bits of the layers they become.
NATIVE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_0": 8, "IQ4_NL": 8, "IQ4_XS": 8, "Q6_K": 6, "Q3_K": 6}


def read_blocks(data: np.ndarray, kind: str, rows: int, cols: int) -> Blocks | None:
    """The groups of one tensor's raw blocks ([rows, bytes per row] uint8), or None for a type
    that does not fit (Q5_1, Q5_K, Q2_K, floats...)."""
    if cols % GROUP or kind not in NATIVE_BITS:
        return None
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if kind in ("Q5_0", "IQ4_NL", "IQ4_XS", "Q3_K"):
        return _read_other(raw, kind, rows)
    if kind == "Q8_0":  # 34 bytes: d (f16), 32 × int8
        b = raw.reshape(rows, -1, 34)
        return Blocks(
            8,
            torch.from_numpy(b[..., 2:].copy().view(np.int8).astype(np.int16)),
            torch.from_numpy(_f16(b[..., :2])[..., 0]),
            None,
        )
    if kind in ("Q4_0", "Q4_1"):  # d (f16), [m (f16)], 16 bytes: q[j] low nibble, q[j+16] high
        head = 2 if kind == "Q4_0" else 4
        b = raw.reshape(rows, -1, head + 16)
        d = _f16(b[..., :2])[..., 0]
        m = -8 * d if kind == "Q4_0" else _f16(b[..., 2:4])[..., 0]
        qs = b[..., head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return Blocks(4, torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)))
    if kind == "Q4_K":  # 144 bytes per 256: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        b = raw.reshape(rows, -1, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [rows, blocks, 1]
        s = b[..., 4:16].reshape(rows, -1, 3, 4)
        lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [rows, blocks, 8]
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(rows, -1, GROUP)  # sub-block 2i: low nibbles of 32 bytes, 2i+1: high
        scales = (d * sc.astype(np.float32)).reshape(rows, -1)
        mins = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
        # the same values as d·sc and (−dmin)·m, one float32 product each: the super-block form exactly
        factors = SuperScales(
            torch.from_numpy(np.ascontiguousarray(d[..., 0])),
            torch.from_numpy(sc.reshape(rows, -1).copy()),
            torch.from_numpy(np.ascontiguousarray(-dmin[..., 0])),
            torch.from_numpy(mn.reshape(rows, -1).astype(np.int8)),
        )
        return Blocks(
            4, torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(scales), torch.from_numpy(mins), factors
        )
    if kind == "Q6_K":  # 210 bytes per 256: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d (f16)
        b = raw.reshape(rows, -1, 210)
        low = (
            b[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ) & 0x0F
        high = (
            b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        ) & 0x03
        q = (low.reshape(rows, -1, GROUP) | (high.reshape(rows, -1, GROUP) << 4)).astype(
            np.uint8
        )  # [rows, groups, 32], 0..63
        sc = b[..., 192:208].copy().view(np.int8).reshape(rows, -1)  # [rows, groups · 2]: one per 16 weights
        d = _f16(b[..., 208:210])[..., 0]  # [rows, blocks]
        factors = SuperScales(torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(sc), per_group=2)
        return Blocks(6, torch.from_numpy(np.ascontiguousarray(q)), factors.scales(), None, factors)
    return None


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32]: q[j] the low nibble of byte j, q[j + 16] its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _read_other(raw: np.ndarray, kind: str, rows: int) -> Blocks:
    """Q5_0, IQ4_NL and IQ4_XS as int8 groups (a float32 scale each), Q3_K as 6-bit groups."""
    if kind == "Q5_0":  # 22 bytes per 32: d (f16), the 32 high bits (u32), 16 bytes of low nibbles
        b = raw.reshape(rows, -1, 22)
        high = (b[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1  # [rows, groups, 32]
        q = (_nibbles(b[..., 6:]).astype(np.int16) | (high.astype(np.int16) << 4)) - 16
        return Blocks(8, torch.from_numpy(q), torch.from_numpy(_f16(b[..., :2])[..., 0]), None)
    if kind == "IQ4_NL":  # 18 bytes per 32: d (f16), 16 bytes of nibbles indexing the levels
        b = raw.reshape(rows, -1, 18)
        q = IQ4_LEVELS[_nibbles(b[..., 2:])]
        return Blocks(8, torch.from_numpy(q), torch.from_numpy(_f16(b[..., :2])[..., 0]), None)
    if kind == "IQ4_XS":  # 136 bytes per 256: d (f16), high scale bits (u16), 4 bytes of low ones, 128 of nibbles
        b = raw.reshape(rows, -1, 136)
        d = _f16(b[..., :2])  # [rows, blocks, 1]
        high = (b[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [rows, blocks, 8]
        low = np.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], axis=-1).reshape(rows, -1, 8)
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        scales = (d * ls.astype(np.float32)).reshape(rows, -1)  # [rows, groups], as gguf-py computes them
        q = IQ4_LEVELS[_nibbles(b[..., 8:].reshape(rows, -1, 8, 16))].reshape(rows, -1, GROUP)
        return Blocks(8, torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(scales)), None)
    # Q3_K: 110 bytes per 256: 32 bytes of high-bit masks, 64 of 2-bit pairs, 12 of 6-bit scales, d (f16)
    b = raw.reshape(rows, -1, 110)
    low = (b[..., 32:96].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    mask = (b[..., :32].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = low.reshape(rows, -1, 256).astype(np.int16) - ((mask.reshape(rows, -1, 256) ^ 1).astype(np.int16) << 2)
    s = b[..., 96:108]
    sl = np.stack([s[..., :8] & 0x0F, s[..., :8] >> 4], axis=-2).reshape(rows, -1, 16)
    sh = ((s[..., 8:12].reshape(rows, -1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3).reshape(
        rows, -1, 16
    )
    sc = ((sl | (sh << 4)).astype(np.int8) - np.int8(32)).reshape(rows, -1)  # [rows, groups · 2]: one per 16
    factors = SuperScales(
        torch.from_numpy(np.ascontiguousarray(_f16(b[..., 108:110])[..., 0])), torch.from_numpy(sc), per_group=2
    )
    q6 = (q + 32).astype(np.uint8).reshape(rows, -1, GROUP)  # [rows, groups, 32], 28..35
    return Blocks(6, torch.from_numpy(q6), factors.scales(), None, factors)


# Outputs converted at a time (a multiple of the kernel's blocks of 8): larger slices leave the
# allocator fragmented (4,096 rows: 0.27 GB more at the 1.5B's peak, no faster).
CHUNK_ROWS = 1024


Rows = Callable[[int, int], np.ndarray]  # (start, stop) → those outputs' raw blocks [stop − start, bytes per row]


def rows_of(raw: np.ndarray, rows: int, order: np.ndarray | None = None) -> Rows:
    """Row slices of raw blocks in memory, taken in `order` where given (the permutation
    `transformers` applies to a tensor)."""
    raw = raw.reshape(rows, -1)
    return lambda start, stop: raw[start:stop] if order is None else raw[order[start:stop]]


def packed_layer(source: Rows, kind: str, rows: int, cols: int, bias: torch.Tensor | None) -> QuantizedLinear | None:
    """A layer of a tensor's raw blocks, read and converted `CHUNK_ROWS` outputs at a time into
    the layer's own (huge-page) memory: the only whole-size buffer is the layer itself. None for
    a type `read_blocks` does not take."""
    if kind not in NATIVE_BITS or cols % GROUP:
        return None
    bits, super_blocks = NATIVE_BITS[kind], kind in SUPER_KINDS
    packed = huge_page_empty(packed_shape(bits, rows, cols, super_blocks))
    for start in range(0, rows, CHUNK_ROWS):
        stop = min(rows, start + CHUNK_ROWS)
        blocks = read_blocks(source(start, stop), kind, stop - start, cols)
        assert blocks is not None
        packed[start // BLOCK : -(-stop // BLOCK)] = _packed(blocks)
    return QuantizedLinear(packed, bits, rows, cols, bias, super_blocks, copy=False)


SUPER_KINDS = frozenset({"Q4_K", "Q6_K", "Q3_K"})  # scales in the super-block form


def _packed(blocks: Blocks) -> torch.Tensor:
    """The kernel's packed records of these groups (no layer, no huge-page copy), from q as read."""
    dtype = torch.int8 if blocks.bits == 8 else torch.uint8
    q = blocks.q.to(dtype).view(torch.uint8)  # [rows, groups, 32]: 0..15, 0..63 or int8 bytes
    if blocks.factors is not None:
        return pack_super(q, blocks.factors, blocks.bits)
    return pack(q, blocks.scales, blocks.mins, blocks.bits)
