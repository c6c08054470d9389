"""Group-quantized weights: int8 or int4 linear layers, prepared once at load.

`quantize_model(model, "int4")` swaps every `nn.Linear` whose input size is a multiple of 32 for
a `QuantizedLinear`: weights in groups of 32 along the input, int8 with a scale per group
(w = d·q, GGUF's Q8_0) or 4-bit with a scale and a minimum per group (w = d·q + min, q in 0..15,
the layout of GGUF's Q4_1; Q4_0 and Q4_K fit it too). The output layer (LM head) is kept at int8
in int4 mode, as llama.cpp's Q4_K_M keeps it at 6 bits. A model loaded from a GGUF file takes the
file's own groups where they fit (`gguf_blocks`): the quantized model is the file's model. The
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
    """Round `weight` [out, in] to groups of 32 along `in`. Returns (qweight, scales, mins):
    bits 8: qweight int8 stored as uint8 [out, in], scales [out, in/32], mins None;
    bits 4: qweight uint8 [out, in/2] (byte j of a group holds q[j] in its low half, q[j+16] in its
    high half), scales and mins [out, in/32]."""
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"in_features {in_features} is not a multiple of {GROUP}")
    w = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)  # [out, groups, 32]
    if bits == 8:
        scales = w.abs().amax(-1) / 127  # [out, groups]
        q = torch.round(w / torch.where(scales > 0, scales, 1).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return q.reshape(out_features, in_features).view(torch.uint8), scales.contiguous(), None
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    low, high = w.amin(-1), w.amax(-1)  # [out, groups]
    scales = (high - low) / 15
    q = torch.round((w - low.unsqueeze(-1)) / torch.where(scales > 0, scales, 1).unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return pack_int4(q), scales.contiguous(), low.contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, groups, 32] in 0..15 → [out, groups * 16] bytes (q[j] | q[j+16] << 4)."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [out, groups * 16] bytes → q [out, groups, 32]."""
    b = packed.reshape(packed.shape[0], -1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The float32 weight [out, in] that the quantized one stands for."""
    if bits == 8:
        q = qweight.view(torch.int8).reshape(qweight.shape[0], -1, GROUP).float()
        return (q * scales.unsqueeze(-1)).reshape(qweight.shape[0], -1)
    assert mins is not None
    q = unpack_int4(qweight).float()  # [out, groups, 32]
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(qweight.shape[0], -1)


BLOCK = 8  # outputs per packed block (quant.cpp)
RECORD = {4: 128 + 64, 8: 256 + 32}  # bytes per (block, group) record: weights, scales(, mins)


def pack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Groups (`quantize_weight`'s layout) → the kernel's packed records [ceil(out/8), in/32, RECORD]:
    per block of 8 outputs and group, the weights with lane j = output j (see quant.cpp), then the
    8 scales (and 8 minimums) as float32. Outputs past `out` are zero padding."""
    n, groups = scales.shape
    blocks = -(-n // BLOCK)
    pad = blocks * BLOCK - n
    if bits == 4:
        q = unpack_int4(qweight)  # [out, groups, 32] in 0..15
    else:
        q = qweight.reshape(n, groups, GROUP)  # int8 bytes
    q = nn.functional.pad(q, (0, 0, 0, 0, 0, pad))  # [blocks*8, groups, 32]
    chunks = q.reshape(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [blocks, groups, chunk, j, e]
    if bits == 4:  # chunk k (elements 4k..4k+3) in the low nibbles, chunk k+4 in the high ones
        weights = chunks[:, :, :4] | (chunks[:, :, 4:] << 4)  # [blocks, groups, 4, 8, 4]
    else:
        weights = chunks
    parts = [weights.reshape(blocks, groups, -1)]
    for values in (scales, mins) if bits == 4 else (scales,):
        lanes = nn.functional.pad(values.float(), (0, 0, 0, pad)).reshape(blocks, BLOCK, groups).transpose(1, 2)  # [blocks, groups, 8]
        parts.append(lanes.contiguous().view(torch.uint8))  # [blocks, groups, 32]
    return torch.cat(parts, dim=-1).contiguous()


def unpack(packed: torch.Tensor, bits: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `pack`: (qweight, scales, mins) in `quantize_weight`'s layout."""
    blocks, groups, _ = packed.shape
    body = 128 if bits == 4 else 256
    raw = packed[..., :body].reshape(blocks, groups, -1, BLOCK, 4)  # [blocks, groups, 4 or 8, j, e]
    chunks = torch.cat([raw & 0x0F, raw >> 4], dim=2) if bits == 4 else raw  # [blocks, groups, 8, j, e]
    q = chunks.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK, groups, GROUP)[:out_features]  # [out, groups, 32]

    def lanes(offset: int) -> torch.Tensor:
        values = packed[..., offset : offset + 32].contiguous().view(torch.float32)  # [blocks, groups, 8]
        return values.transpose(1, 2).reshape(blocks * BLOCK, groups)[:out_features].contiguous()

    if bits == 4:
        return pack_int4(q), lanes(body), lanes(body + 32)
    return q.reshape(out_features, -1).contiguous(), lanes(body), None


class QuantizedLinear(nn.Module):
    """A linear layer with group-quantized weights (see the module doc); float32 in and out. The
    weights are held only in the kernel's packed layout (`pack`); `groups()` gives them back."""

    isa: int = BEST  # another path (PORTABLE, AVX2, AVX512_VNNI): for tests of other machines

    def __init__(self, packed: torch.Tensor, bits: int, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if bits not in RECORD or packed.shape != (-(-out_features // BLOCK), in_features // GROUP, RECORD[bits]) or in_features % GROUP:
            raise ValueError(f"packed weights {tuple(packed.shape)} do not fit a {bits}-bit {in_features}→{out_features} layer")
        self.bits = bits
        self.out_features = out_features
        self.in_features = in_features
        self.register_buffer("packed", packed)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_groups(cls, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                    bias: torch.Tensor | None) -> QuantizedLinear:
        return cls(pack(qweight, scales, mins, bits), bits, scales.shape[0], scales.shape[1] * GROUP, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> QuantizedLinear:
        return cls.from_groups(*quantize_weight(linear.weight, bits), bits, linear.bias)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, mins) as `quantize_weight` gives them."""
        return unpack(self.packed, self.bits, self.out_features)

    def weight_float(self) -> torch.Tensor:
        """The de-quantized weight [out, in] (for reference checks and the no-compiler path)."""
        return dequantize(*self.groups(), self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = kernel() if x.device.type == "cpu" else None
        if module is None:
            flat = x.reshape(-1, x.shape[-1]).float()  # [rows, in]
            out = nn.functional.linear(_activations_reference(flat), self.weight_float(), self.bias)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        out = module.quantized_linear(x.float(), self.packed, self.bits, self.out_features, self.bias, self.isa)  # [..., out]
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, bias={self.bias is not None}"


def _activations_reference(x: torch.Tensor) -> torch.Tensor:
    """Activations rounded per row and group as the kernel rounds them (int8, scale max|x|/127)."""
    g = x.reshape(x.shape[0], -1, GROUP)  # [rows, groups, 32]
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g * torch.where(d > 0, 1 / d, 0)).clamp(-127, 127)
    return (q * d).reshape(x.shape)


def quantize_model(model: nn.Module, mode: str, file_blocks: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None) -> int:
    """Swap `model`'s linear layers for group-quantized ones (`mode` "int8" or "int4"; the output
    layer stays int8). Layers whose input is not a multiple of 32 stay float (logged). With
    `file_blocks` (for a GGUF source: `leapdecode.models.gguf_blocks.gguf_blocks_by_weight` on the
    file; called with the weights by name, it returns the file's own groups for those it stores as
    Q4_0, Q4_1, Q4_K or Q8_0) and int4, those layers take the file's groups, and the others, stored
    wider than 4 bits, are rounded to int8. Returns how many layers were swapped."""
    if mode not in BITS:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZE_MODES)}")
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
            layer = QuantizedLinear.from_groups(*blocks[full].groups(), blocks[full].bits, child.bias)
        else:
            wide = child is head or (file_blocks is not None and mode == "int4")
            layer = QuantizedLinear.from_linear(child, 8 if wide else BITS[mode])
        setattr(parent, name, layer)
        swapped += 1
    if kept:
        logger.info("kept %d linear layers in float (input not a multiple of %d): %s", len(kept), GROUP, ", ".join(kept[:4]))
    return swapped


def _linear_layers(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """Every `nn.Linear` of `model` by its full name, with its parent and its attribute name there."""
    return {f"{parent_name}.{name}".lstrip("."): (parent, name, child) for parent_name, parent in model.named_modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)}


def save_quantized(model: nn.Module, path: Path) -> None:
    """Write every `QuantizedLinear`'s packed records to one safetensors file (what `load_quantized` reads)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear):
            tensors[f"{name}.packed"] = layer.packed
            tensors[f"{name}.shape"] = torch.tensor([layer.bits, layer.out_features, layer.in_features], dtype=torch.int64)
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
    if not names or not names <= linears.keys() or any(f"{n}.packed" not in saved or f"{n}.shape" not in saved for n in names):
        return 0
    layers = {}
    for name in names:
        child = linears[name][2]
        bits, out_features, in_features = (int(v) for v in saved[f"{name}.shape"])
        if (out_features, in_features) != (child.out_features, child.in_features):
            return 0
        try:
            layers[name] = QuantizedLinear(saved[f"{name}.packed"], bits, out_features, in_features, child.bias)
        except ValueError:
            return 0
    for name, layer in layers.items():
        parent, attr, _ = linears[name]
        setattr(parent, attr, layer)
    return len(layers)
