"""The kernel's packed weight layout (`quant.cpp`): blocks of 8 outputs, one record per block and
group (the 8 outputs' weights interleaved, then their scales), so a layer streams from memory in
one sequential read. `pack`/`unpack` for per-group float32 scales, `pack_super`/`unpack_super`
for the super-block form (a header of factors per block and run of 8 groups); each unpack is its
pack's exact inverse.
"""

from __future__ import annotations

import torch
from torch import nn

from leapdecode.models.rounding import GROUP, SUPER, SuperScales, pack_int4, unpack_int4

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
    """qweight (`quantize_weight`'s layout, or already as q [out, groups, 32] uint8: a GGUF's
    blocks, unpacked once) → the records' weights [ceil(n/8), groups, BODY]."""
    blocks = -(-n // BLOCK)
    if qweight.dim() == 3:
        q = qweight  # [out, groups, 32]: 0..15, 0..63 or int8 bytes
    else:
        q = unpack_int4(qweight) if bits == 4 else qweight.reshape(n, groups, GROUP)
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
