"""Group-quantized weights: int8 or int4 linear layers, prepared once at load.

`quantize_model(model, "int4")` swaps every `nn.Linear` whose input size is a multiple of 32 for
a `QuantizedLinear`: weights in groups of 32 along the input, int8 with a scale per group
(w = d·q, GGUF's Q8_0) or 4-bit with a scale and a minimum per group (w = d·q + min, q in 0..15,
the layout of GGUF's Q4_1; Q4_0 and Q4_K fit it too). The scales are stored per group as float32
(any scales: GGUF's Q4_0, Q4_1, Q8_0) or, in the super-block form (`SuperScales`, GGUF's Q4_K
exactly, and what this module's own rounding produces), as 8-bit multiples of one float32 factor
per output and run of 8 groups: a quarter fewer bytes per int4 weight, and a one-token pass reads
every weight once, so it is that much faster. A GGUF's Q6_K weights (w = d·sc·(q − 32), an int8 sc
per 16 weights) keep their 6 bits in that form too (`bits` 6). The output layer (LM head) is kept
at int8 in int4 mode (a GGUF's Q6_K one at its 6 bits), as llama.cpp's Q4_K_M keeps it at 6 bits.
A model loaded from a GGUF file takes the file's own groups where they fit (`gguf_blocks`): the
quantized model is the file's model. The
weights are held in the kernel's packed layout (`pack`: blocks of 8 outputs, one record per block
and group, so a layer streams from memory in one sequential read). The kernel (`quant.cpp`) quantizes each
row's activations to int8 per group at run time, so a group's dot product is an exact integer sum,
and it is row-exact by construction: row i of an M-row pass is bitwise a one-row pass, so greedy
drafting on a quantized model is lossless with respect to that model's own plain decoding.

Without a C++ compiler the layers run the same arithmetic through torch (de-quantized weights;
correct, slow, not bitwise the kernel's). The kernel picks its path at run time: AVX512-VNNI where
the CPU has it, else AVX2, else portable scalar code; all three give the same bits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leapdecode.models.extensions import build

logger = logging.getLogger("leapdecode")

GROUP = 32  # weights per group along the input dimension
QUANTIZE_MODES = ("none", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
# The kernel's instruction-set paths (`QuantizedLinear.isa`); BEST: the fastest this CPU runs.
BEST, PORTABLE, AVX2, AVX512_VNNI = -1, 0, 1, 2


@functools.cache
def kernel() -> Any | None:
    """The compiled quantized-linear extension, or None (logged) where it cannot be built."""
    module = build("quant", "quant.cpp")
    if module is None:
        logger.warning("quantized layers fall back to de-quantized torch products (slow)")
    else:
        logger.info("quantized kernel: the %s path", ("portable", "AVX2", "AVX512-VNNI")[module.best_isa()])
    return module


def quantize_weight(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round `weight` [out, in] to groups of 32 along `in`, each with its own float32 scale (and
    minimum). Returns (qweight, scales, mins):
    bits 8: qweight int8 stored as uint8 [out, in], scales [out, in/32], mins None;
    bits 4: qweight uint8 [out, in/2] (byte j of a group holds q[j] in its low half, q[j+16] in its
    high half), scales and mins [out, in/32]."""
    w = _groups_of(weight, bits)  # [out, groups, 32]
    if bits == 8:
        scales = w.abs().amax(-1) / 127  # [out, groups]
        return _round_int8(w, scales), scales.contiguous(), None
    low, high = w.amin(-1), w.amax(-1)  # [out, groups]
    scales = (high - low) / 15
    return _round_int4(w, scales, low), scales.contiguous(), low.contiguous()


SUPER = 8  # groups per super-block: one float32 factor (and one for the minimums) per output


@dataclass(frozen=True)
class SuperScales:
    """Group scales (and int4 minimums) as 8-bit multiples of one float32 factor per output and
    super-block of `SUPER` groups (the last may be shorter): scale[n, g] = d[n, g // 8] · sc[n, g],
    minimum[n, g] = dmin[n, g // 8] · m[n, g], each one float32 product (as the kernel computes it).
    GGUF's Q4_K is this form with 6-bit sc and m (its minimum's sign folded into dmin); its Q6_K
    has an int8 sc per half group (`per_group` 2: sc [out, 2·groups], scale per 16 weights)."""

    d: torch.Tensor  # [out, supers] float32
    sc: torch.Tensor  # [out, groups · per_group] uint8 (int8 for 6 bits)
    dmin: torch.Tensor | None = None  # [out, supers] float32 (int4)
    m: torch.Tensor | None = None  # [out, groups] int8 (int4)
    per_group: int = 1

    @property
    def groups(self) -> int:
        return self.sc.shape[1] // self.per_group

    def scales(self) -> torch.Tensor:
        """[out, groups · per_group] float32."""
        return _per_group(self.d, self.sc.shape[1], SUPER * self.per_group) * self.sc.float()

    def mins(self) -> torch.Tensor | None:
        """[out, groups] float32, or None (int8, 6 bits)."""
        if self.dmin is None or self.m is None:
            return None
        return _per_group(self.dmin, self.m.shape[1]) * self.m.float()

    def rows(self, index: torch.Tensor) -> SuperScales:
        """The factors of the outputs `index` (a permutation, for a GGUF's reordered rows)."""
        return SuperScales(
            self.d[index],
            self.sc[index],
            None if self.dmin is None else self.dmin[index],
            None if self.m is None else self.m[index],
            self.per_group,
        )


def _per_group(factors: torch.Tensor, columns: int, repeat: int = SUPER) -> torch.Tensor:
    return factors.float().repeat_interleave(repeat, dim=1)[:, :columns]  # [out, columns]


def _by_super(values: torch.Tensor) -> torch.Tensor:
    """[out, groups] → [out, supers, 8], the last super-block padded with zeros."""
    pad = -values.shape[1] % SUPER
    return nn.functional.pad(values, (0, pad)).reshape(values.shape[0], -1, SUPER)


def quantize_weight_super(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, SuperScales]:
    """Round `weight` [out, in] to groups of 32 whose scales (and minimums) are in the super-block
    form: the factors first (8-bit, the minimums rounded down and the scales up, so that every
    group's range is still covered), then the weights with the scales as the kernel will see them.
    Returns (qweight as `quantize_weight` gives it, the factors)."""
    w = _groups_of(weight, bits)  # [out, groups, 32]
    if bits == 8:
        d, sc = _factor_up(w.abs().amax(-1) / 127)
        factors = SuperScales(d, sc)
        return _round_int8(w, factors.scales()), factors
    low, high = w.amin(-1), w.amax(-1)  # [out, groups]
    dmin = _by_super(low).abs().amax(-1) / 126  # [out, supers]: room for the rounding down below
    m = torch.floor(low / _per_group(torch.where(dmin > 0, dmin, 1), low.shape[1])).clamp(-127, 127).to(torch.int8)
    mins = _per_group(dmin, low.shape[1]) * m.float()  # ≤ low
    d, sc = _factor_up((high - mins) / 15)
    factors = SuperScales(d, sc, dmin.contiguous(), m.contiguous())
    return _round_int4(w, factors.scales(), mins), factors


def _factor_up(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative [out, groups] as d [out, supers] · sc (uint8) with d · sc ≥ each value (up to
    the last bit: the weights are rounded against the products, whatever they are)."""
    d = _by_super(values).amax(-1) / 254  # [out, supers]: room for the rounding up
    sc = torch.ceil(values / _per_group(torch.where(d > 0, d, 1), values.shape[1])).clamp(0, 255).to(torch.uint8)
    return d.contiguous(), sc.contiguous()


def _groups_of(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [out, in] → float32 [out, in/32, 32], checking the shape and bits."""
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"in_features {in_features} is not a multiple of {GROUP}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    return weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)


def _round_int8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w [out, groups, 32], scales [out, groups] → int8 q as uint8 [out, in]."""
    q = torch.round(w / torch.where(scales > 0, scales, 1).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape[0], -1).view(torch.uint8)


def _round_int4(w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """w [out, groups, 32], scales and mins [out, groups] → packed 4-bit q [out, in/2]."""
    q = (
        torch.round((w - mins.unsqueeze(-1)) / torch.where(scales > 0, scales, 1).unsqueeze(-1))
        .clamp(0, 15)
        .to(torch.uint8)
    )
    return pack_int4(q)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, groups, 32] in 0..15 → [out, groups * 16] bytes (q[j] | q[j+16] << 4)."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [out, groups * 16] bytes → q [out, groups, 32]."""
    b = packed.reshape(packed.shape[0], -1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The float32 weight [out, in] that the quantized one stands for (6 bits: qweight uint8 q in
    0..63 [out, in], scales per 16 weights [out, in/16], w = scale · (q − 32))."""
    if bits == 6:
        return scales.repeat_interleave(GROUP // 2, dim=1) * (qweight.float() - 32)
    if bits == 8:
        q = qweight.view(torch.int8).reshape(qweight.shape[0], -1, GROUP).float()
        return (q * scales.unsqueeze(-1)).reshape(qweight.shape[0], -1)
    assert mins is not None
    q = unpack_int4(qweight).float()  # [out, groups, 32]
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(qweight.shape[0], -1)


BLOCK = 8  # outputs per packed block (quant.cpp)
BODY = {4: 128, 6: 192, 8: 256}  # bytes of a (block, group) record's weights
RECORD = {4: 128 + 64, 8: 256 + 32}  # bytes per record with per-group scales: weights, scales(, mins)
SUPER_RECORD = {4: 128 + 16, 6: 192 + 16, 8: 256 + 8}  # the same in the super-block form: weights, sc(, m)
SUPER_HEADER = {4: 64, 6: 32, 8: 32}  # bytes per (block, super-block) header: 8 d(, 8 dmin) as float32


def block_bytes(bits: int, groups: int, super_blocks: bool) -> int:
    """Bytes of one output block's records (and headers)."""
    if not super_blocks:
        return groups * RECORD[bits]
    return groups * SUPER_RECORD[bits] + -(-groups // SUPER) * SUPER_HEADER[bits]


def packed_shape(bits: int, out_features: int, in_features: int, super_blocks: bool) -> tuple[int, ...]:
    if bits not in BODY or (bits == 6 and not super_blocks):
        raise ValueError(f"no packed layout for {bits} bits{'' if super_blocks else ' with per-group scales'}")
    blocks, groups = -(-out_features // BLOCK), in_features // GROUP
    return (blocks, block_bytes(bits, groups, True)) if super_blocks else (blocks, groups, RECORD[bits])


def pack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Groups (`quantize_weight`'s layout) → the kernel's packed records [ceil(out/8), in/32, RECORD]:
    per block of 8 outputs and group, the weights with lane j = output j (see quant.cpp), then the
    8 scales (and 8 minimums) as float32. Outputs past `out` are zero padding."""
    blocks = -(-scales.shape[0] // BLOCK)
    parts = [_bodies(qweight, bits, *scales.shape)]
    parts += [
        _lanes(values.float(), blocks).view(torch.uint8) for values in ((scales, mins) if bits == 4 else (scales,))
    ]  # each [blocks, groups, 32]
    return torch.cat(parts, dim=-1).contiguous()


def pack_super(qweight: torch.Tensor, factors: SuperScales, bits: int) -> torch.Tensor:
    """Groups with super-block scales (`quantize_weight_super`'s) → the kernel's packed bytes
    [ceil(out/8), block_bytes]: per block of 8 outputs and run of 8 groups, a header (the 8
    outputs' d, then for int4 their dmin, as float32), then per group the weights as in `pack` and
    the 8 sc (and 8 m) bytes."""
    n, groups = factors.sc.shape[0], factors.groups
    blocks = -(-n // BLOCK)
    if (bits == 4) != (factors.dmin is not None and factors.m is not None) or factors.per_group != (
        2 if bits == 6 else 1
    ):
        raise ValueError(
            f"{bits}-bit super-block factors need {'d, sc, dmin and m' if bits == 4 else 'd and sc alone'}"
            f"{', sc per half group' if bits == 6 else ''}"
        )
    if bits == 6:  # the halves' scales: all 8 outputs' first, then all 8 outputs' second
        halves = factors.sc.view(torch.uint8).reshape(n, groups, 2)
        subs = [halves[..., 0], halves[..., 1]]
    else:
        subs = [factors.sc] + ([factors.m.view(torch.uint8)] if factors.m is not None else [])
    records = torch.cat(
        [_bodies(qweight, bits, n, groups), *(_lanes(v, blocks) for v in subs)], dim=-1
    )  # [blocks, groups, SUPER_RECORD]
    records = nn.functional.pad(records, (0, 0, 0, -groups % SUPER)).reshape(blocks, -1, SUPER * SUPER_RECORD[bits])
    heads = [factors.d] + ([factors.dmin] if factors.dmin is not None else [])
    headers = torch.cat(
        [_lanes(f.float(), blocks).view(torch.uint8) for f in heads], dim=-1
    )  # [blocks, supers, SUPER_HEADER]
    packed = torch.cat([headers, records], dim=-1).reshape(blocks, -1)
    return packed[:, : block_bytes(bits, groups, True)].contiguous()


def _bodies(qweight: torch.Tensor, bits: int, n: int, groups: int) -> torch.Tensor:
    """qweight (`quantize_weight`'s layout) → the records' weights [ceil(n/8), groups, BODY]."""
    blocks = -(-n // BLOCK)
    q = (
        unpack_int4(qweight) if bits == 4 else qweight.reshape(n, groups, GROUP)
    )  # [out, groups, 32]: 0..15, 0..63 or int8 bytes
    q = nn.functional.pad(q, (0, 0, 0, 0, 0, blocks * BLOCK - n))  # [blocks*8, groups, 32]
    chunks = q.reshape(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [blocks, groups, chunk, j, e]
    if bits == 8:  # offset binary, q + 128 (see quant.cpp)
        return (chunks ^ 0x80).reshape(blocks, groups, -1)
    low = chunks & 0x0F  # chunk k (elements 4k..4k+3) in the low nibbles, chunk k+4 in the high ones
    nibbles = (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(blocks, groups, -1)  # [blocks, groups, 128]
    if bits == 4:
        return nibbles
    high = chunks >> 4  # 6 bits: the top pairs, chunk 4h+k at bits 2k..2k+1 of the h-th 32 bytes
    pairs = sum(high[:, :, k::4] << (2 * k) for k in range(4))  # [blocks, groups, 2, 8, 4]
    return torch.cat([nibbles, pairs.reshape(blocks, groups, -1)], dim=-1)


def _q_of_bodies(bodies: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """The inverse of `_bodies`: [blocks, groups, BODY] → qweight in `quantize_weight`'s layout."""
    blocks, groups, _ = bodies.shape
    if bits == 8:
        chunks = bodies.reshape(blocks, groups, 8, BLOCK, 4) ^ 0x80  # [blocks, groups, chunk, j, e]
    else:
        raw = bodies[..., :128].reshape(blocks, groups, 4, BLOCK, 4)
        chunks = torch.cat([raw & 0x0F, raw >> 4], dim=2)  # [blocks, groups, 8, j, e]
        if bits == 6:
            pairs = bodies[..., 128:].reshape(blocks, groups, 2, 1, BLOCK, 4)
            shifts = torch.arange(0, 8, 2, dtype=torch.uint8).reshape(1, 1, 1, 4, 1, 1)
            chunks = chunks | (((pairs >> shifts) & 3) << 4).reshape(blocks, groups, 8, BLOCK, 4)
    q = chunks.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK, groups, GROUP)[:out_features]  # [out, groups, 32]
    return pack_int4(q) if bits == 4 else q.reshape(out_features, -1).contiguous()


def _lanes(values: torch.Tensor, blocks: int) -> torch.Tensor:
    """[out, cols] → [blocks, cols, 8]: lane j holds output 8·block + j (zero past `out`)."""
    padded = nn.functional.pad(values, (0, 0, 0, blocks * BLOCK - values.shape[0]))
    return padded.reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()


def _of_lanes(lanes: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of `_lanes`."""
    return lanes.transpose(1, 2).reshape(-1, lanes.shape[1])[:out_features].contiguous()


def unpack(
    packed: torch.Tensor, bits: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `pack`: (qweight, scales, mins) in `quantize_weight`'s layout."""
    body = BODY[bits]

    def floats(offset: int) -> torch.Tensor:
        return _of_lanes(packed[..., offset : offset + 32].contiguous().view(torch.float32), out_features)

    return _q_of_bodies(packed[..., :body], bits, out_features), floats(body), floats(body + 32) if bits == 4 else None


def unpack_super(packed: torch.Tensor, bits: int, out_features: int, groups: int) -> tuple[torch.Tensor, SuperScales]:
    """The inverse of `pack_super`: (qweight, the factors)."""
    blocks, header, record = packed.shape[0], SUPER_HEADER[bits], SUPER_RECORD[bits]
    supers = -(-groups // SUPER)
    full = nn.functional.pad(packed, (0, supers * (header + SUPER * record) - packed.shape[1])).reshape(
        blocks, supers, -1
    )
    records = full[..., header:].reshape(blocks, supers * SUPER, record)[:, :groups]  # [blocks, groups, record]
    body = BODY[bits]

    def factor(which: int) -> torch.Tensor:
        return _of_lanes(full[..., 32 * which : 32 * which + 32].contiguous().view(torch.float32), out_features)

    def subs(which: int) -> torch.Tensor:
        return _of_lanes(records[..., body + 8 * which : body + 8 * which + 8].contiguous(), out_features)

    if bits == 4:
        factors = SuperScales(factor(0), subs(0), factor(1), subs(1).view(torch.int8))
    elif bits == 6:
        factors = SuperScales(
            factor(0), torch.stack([subs(0), subs(1)], dim=-1).reshape(out_features, -1).view(torch.int8), per_group=2
        )
    else:
        factors = SuperScales(factor(0), subs(0))
    return _q_of_bodies(records[..., :body], bits, out_features), factors


class QuantizedLinear(nn.Module):
    """A linear layer with group-quantized weights (see the module doc); float32 in and out. The
    weights are held only in the kernel's packed layout (`pack`, or `pack_super` with
    `super_blocks`); `groups()` gives them back."""

    isa: int = BEST  # another path (PORTABLE, AVX2, AVX512_VNNI): for tests of other machines

    def __init__(
        self,
        packed: torch.Tensor,
        bits: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        super_blocks: bool = False,
        *,
        copy: bool = True,
    ) -> None:
        """`copy`: take `packed` into memory of its own (huge pages); False: use it as it is (a view
        of weights another layer holds)."""
        super().__init__()
        if (
            bits not in BODY
            or (bits == 6 and not super_blocks)
            or in_features % GROUP
            or packed.dtype != torch.uint8
            or packed.shape != packed_shape(bits, out_features, in_features, super_blocks)
        ):
            raise ValueError(
                f"packed weights {tuple(packed.shape)} do not fit a {bits}-bit {in_features}→{out_features} layer"
                f"{' with super-block scales' if super_blocks else ''}"
            )
        self.bits = bits
        self.super_blocks = super_blocks
        self.out_features = out_features
        self.in_features = in_features
        self.register_buffer("packed", _in_huge_pages(packed) if copy else packed)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_groups(
        cls,
        qweight: torch.Tensor,
        scales: torch.Tensor | SuperScales,
        mins: torch.Tensor | None,
        bits: int,
        bias: torch.Tensor | None,
    ) -> QuantizedLinear:
        """From `quantize_weight`'s groups, or with `scales` a `SuperScales` (mins then None) from
        `quantize_weight_super`'s."""
        if isinstance(scales, SuperScales):
            return cls(
                pack_super(qweight, scales, bits),
                bits,
                scales.sc.shape[0],
                scales.groups * GROUP,
                bias,
                super_blocks=True,
            )
        return cls(pack(qweight, scales, mins, bits), bits, scales.shape[0], scales.shape[1] * GROUP, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> QuantizedLinear:
        """`linear` rounded to `bits` with super-block scales."""
        return cls.from_weight(linear.weight, bits, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """A weight [out, in] (and bias [out]) rounded to `bits` with super-block scales."""
        qweight, factors = quantize_weight_super(weight, bits)
        return cls.from_groups(qweight, factors, None, bits, bias)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, mins) as `quantize_weight` gives them (the scales as the kernel computes them)."""
        if not self.super_blocks:
            return unpack(self.packed, self.bits, self.out_features)
        qweight, factors = unpack_super(self.packed, self.bits, self.out_features, self.in_features // GROUP)
        return qweight, factors.scales(), factors.mins()

    def weight_float(self) -> torch.Tensor:
        """The de-quantized weight [out, in] (for reference checks and the no-compiler path)."""
        return dequantize(*self.groups(), self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = kernel() if x.device.type == "cpu" else None
        if module is None:
            flat = x.reshape(-1, x.shape[-1]).float()  # [rows, in]
            out = nn.functional.linear(_activations_reference(flat), self.weight_float(), self.bias)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        out = module.quantized_linear(
            x.float(), self.packed, self.bits, self.super_blocks, self.out_features, self.bias, self.isa
        )  # [..., out]
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"super_blocks={self.super_blocks}, bias={self.bias is not None}"
        )


def _in_huge_pages(packed: torch.Tensor) -> torch.Tensor:
    """`packed` in memory marked for 2 MiB pages (the kernel's `huge_page_copy`), so a pass that
    streams every weight misses the TLB a 512th as often; unchanged without the kernel or off the CPU.
    (torch's own `THP_MEM_ALLOC_ENABLE` would do this for every allocation of the process, at start.)"""
    module = kernel() if packed.device.type == "cpu" else None
    return packed if module is None else module.huge_page_copy(packed.contiguous())


def _activations_reference(x: torch.Tensor) -> torch.Tensor:
    """Activations rounded per row and group as the kernel rounds them (int8, scale max|x|/127)."""
    g = x.reshape(x.shape[0], -1, GROUP)  # [rows, groups, 32]
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g * torch.where(d > 0, 1 / d, 0)).clamp(-127, 127)
    return (q * d).reshape(x.shape)


def quantize_model(
    model: nn.Module,
    mode: str,
    file_blocks: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
    *,
    head_bits: int = 8,
) -> int:
    """Swap `model`'s linear layers for group-quantized ones (`mode` "int8" or "int4"; the output
    layer at `head_bits`, int8 unless a draft model, whose numerics never reach the output, asks
    for 4). Layers whose input is not a multiple of 32 stay float (logged). With
    `file_blocks` (for a GGUF source: `leapdecode.models.gguf_blocks.gguf_blocks_by_weight` on the
    file; called with the weights by name, it returns the file's own groups for those it stores as
    Q4_0, Q4_1, Q4_K or Q8_0) and int4, those layers take the file's groups, and the others, stored
    wider than 4 bits, are rounded to int8. Returns how many layers were swapped."""
    if mode not in BITS:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZE_MODES)}")
    if head_bits not in BITS.values():
        raise ValueError(f"head_bits must be one of {sorted(BITS.values())}, got {head_bits}")
    kernel()  # build (or find cached) now, not in the first decode step
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = _linear_layers(model)
    blocks = {}
    if file_blocks is not None and mode == "int4":
        blocks = file_blocks({n: c.weight for n, (_, _, c) in linears.items() if not c.in_features % GROUP})
    swapped, kept = 0, []
    for full, (parent, name, child) in linears.items():
        if child.in_features % GROUP:
            kept.append(full)
            continue
        if full in blocks:
            layer = blocks[full].layer(child.bias)
        else:
            wide = file_blocks is not None and mode == "int4"
            layer = QuantizedLinear.from_linear(child, head_bits if child is head else 8 if wide else BITS[mode])
        setattr(parent, name, layer)
        swapped += 1
    if kept:
        logger.info(
            "kept %d linear layers in float (input not a multiple of %d): %s", len(kept), GROUP, ", ".join(kept[:4])
        )
    return swapped


def _linear_layers(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """Every `nn.Linear` of `model` by its full name, with its parent and its attribute name there."""
    return {
        f"{parent_name}.{name}".lstrip("."): (parent, name, child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    }


def save_quantized(model: nn.Module, path: Path) -> None:
    """Write every `QuantizedLinear`'s packed records to one safetensors file (what `load_quantized` reads)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear):
            tensors[f"{name}.packed"] = layer.packed
            tensors[f"{name}.shape"] = torch.tensor(
                [layer.bits, layer.out_features, layer.in_features, layer.super_blocks], dtype=torch.int64
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.replace(path)  # whole or absent: a crash mid-write leaves no half file under the real name


def load_quantized(model: nn.Module, path: Path) -> int:
    """Swap `model`'s linear layers for the records saved in `path` by `save_quantized`. Returns the
    number swapped; 0 (and the model untouched) when the file does not fit this model or is corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        saved = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        logger.warning("ignoring the quantized cache %s (%s)", path, exc)
        return 0
    names = {key.rsplit(".", 1)[0] for key in saved}
    linears = _linear_layers(model)
    if (
        not names
        or not names <= linears.keys()
        or any(f"{n}.packed" not in saved or f"{n}.shape" not in saved for n in names)
    ):
        return 0
    layers = {}
    for name in names:
        child = linears[name][2]
        shape = saved[f"{name}.shape"].tolist()
        if len(shape) != 4 or tuple(shape[1:3]) != (child.out_features, child.in_features):
            return 0
        bits, out_features, in_features, super_blocks = shape
        try:
            layers[name] = QuantizedLinear(  # its own copy (huge pages): the loaded one goes now
                saved.pop(f"{name}.packed"), bits, out_features, in_features, child.bias, bool(super_blocks)
            )
        except ValueError:
            return 0
    for name, layer in layers.items():
        parent, attr, _ = linears[name]
        setattr(parent, attr, layer)
    return len(layers)
