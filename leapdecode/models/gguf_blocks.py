"""A GGUF file's own quantized blocks, as group-quantized layers (`leapdecode.models.quantize`).

A GGUF source is loaded into PyTorch de-quantized (by `transformers`, through gguf-py); rounding
those floats again would make a second model. Instead, for every weight stored in a layout that
fits ours, take the file's integers and scales themselves:
- Q4_0 (w = d·(q − 8)), Q4_1 (w = d·q + m) and Q4_K (w = d·sc·q − dmin·m per group of 32 inside
  a block of 256) → int4 groups with a scale and a minimum;
- Q8_0 (w = d·q) → int8 groups;
- Q6_K (w = d·sc·(q − 32), an int8 sc per 16 weights) → 6-bit groups.
Q4_K's and Q6_K's scales keep their own form, small integers times a float per 256 weights (the
layers' super-block form, `rounding.SuperScales`): the same float32 values, in fewer bytes.
The file's tensors are matched to the model's linear layers by value, not by name (names differ
per architecture, and `transformers` permutes the rows of some): each row of the de-quantized
tensor is looked up among the layer's rows, so a permutation is found and applied.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from leapdecode.models.quantize import QuantizedLinear
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


def read_blocks(data: np.ndarray, kind: str, rows: int, cols: int) -> Blocks | None:
    """The groups of one tensor's raw blocks ([rows, bytes per row] uint8), or None for a type
    that does not fit (Q5, Q2_K, floats...)."""
    if cols % GROUP:
        return None
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
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


def _row_keys(w: np.ndarray) -> list[bytes]:
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in w]


def gguf_blocks_by_weight(
    path: Path, weights: dict[str, torch.Tensor], log: Callable[[str], None]
) -> dict[str, Blocks]:
    """For each named weight [out, in] of the model, the file's own groups when the file stores a
    tensor with exactly these values (up to a row permutation) in a layout that fits."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    wanted: dict[tuple[int, int], list[str]] = {}
    for name, w in weights.items():
        wanted.setdefault(tuple(w.shape), []).append(name)
    found: dict[str, Blocks] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) != 2:
            continue
        cols, rows = (int(n) for n in tensor.shape)  # gguf lists the fastest dimension first
        names = [n for n in wanted.get((rows, cols), []) if n not in found]
        if not names:
            continue
        blocks = read_blocks(tensor.data, tensor.tensor_type.name, rows, cols)
        if blocks is None:
            continue
        values = dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols)
        keys = {key: i for i, key in enumerate(_row_keys(values))}
        for name in names:
            w = weights[name].detach().float().cpu().numpy()
            if _row_keys(w[:1])[0] not in keys:  # cheap rejection before hashing every row
                continue
            order = [keys.get(key, -1) for key in _row_keys(w)]
            if -1 in order:
                continue
            index = torch.tensor(order)
            found[name] = blocks.rows(index)
            break
    log(f"took {len(found)} of {len(weights)} linear weights from the GGUF's own blocks")
    return found
