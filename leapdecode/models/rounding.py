"""Rounding weights to groups of 32: int8 with a scale per group (GGUF's Q8_0), or 4-bit with a
scale and a minimum per group (GGUF's Q4_1 layout), the scales as float32 or in the super-block
form (`SuperScales`: 8-bit multiples of one float32 factor per output and run of 8 groups, GGUF's
Q4_K). The float32 reference every packed layout and kernel path is checked against.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

GROUP = 32  # weights per group along the input dimension


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


def rounding_version() -> str:
    """A short hash of this module's source: what names a cached rounding (a draft model's int4
    layers), so that a changed rounding is computed afresh, never read back."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]
