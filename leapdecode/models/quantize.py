"""Group-quantized weights: int8 or int4 linear layers, prepared once at load.

`quantize_model(model, "int4")` swaps every `nn.Linear` whose input size is a multiple of 32 for
a `QuantizedLinear`: weights in groups of 32 along the input, int8 with a scale per group
(w = d·q, GGUF's Q8_0) or 4-bit with a scale and a minimum per group (w = d·q + min, q in 0..15,
the layout of GGUF's Q4_1; Q4_0 and Q4_K fit it too). The output layer (LM head) is kept at int8
in int4 mode, as llama.cpp's Q4_K_M keeps it at 6 bits. A model loaded from a GGUF file takes the
file's own groups where they fit (`gguf_blocks`): the quantized model is the file's model. The kernel (`quant.cpp`) quantizes each
row's activations to int8 per group at run time, so a group's dot product is an exact integer sum,
and it is row-exact by construction: row i of an M-row pass is bitwise a one-row pass, so greedy
drafting on a quantized model is lossless with respect to that model's own plain decoding.

Without a C++ compiler the layers run the same arithmetic through torch (de-quantized weights;
correct, slow, not bitwise the kernel's); a CPU without AVX2 runs the kernel's portable path, which
gives the same bits as the AVX2 path.
"""

from __future__ import annotations

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


def kernel() -> Any | None:
    """The compiled quantized-linear extension, or None (logged) where it cannot be built."""
    module = build("quant", "quant.cpp")
    if module is None:
        logger.warning("quantized layers fall back to de-quantized torch products (slow)")
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


class QuantizedLinear(nn.Module):
    """A linear layer with group-quantized weights (see the module doc); float32 in and out."""

    portable: bool = False  # force the kernel's portable path (tests of machines without AVX2)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bits = bits
        self.out_features = qweight.shape[0]
        self.in_features = scales.shape[1] * GROUP
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins if mins is not None else torch.empty(0))
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> QuantizedLinear:
        qweight, scales, mins = quantize_weight(linear.weight, bits)
        return cls(qweight, scales, mins, bits, linear.bias)

    def weight_float(self) -> torch.Tensor:
        """The de-quantized weight [out, in] (for reference checks and the no-compiler path)."""
        return dequantize(self.qweight, self.scales, self.mins if self.bits == 4 else None, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()  # [rows, in]
        module = kernel() if x.device.type == "cpu" else None
        bias = self.bias if self.bias is not None else flat.new_empty(0)
        if module is None:
            out = nn.functional.linear(_activations_reference(flat), self.weight_float(), self.bias)
        else:
            out = module.quantized_linear(flat, self.qweight, self.scales, self.mins, bias, self.bits, self.portable)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)  # [..., out]

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
            layer = QuantizedLinear(*blocks[full].packed(), blocks[full].bits, child.bias)
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
    """Write every `QuantizedLinear`'s groups to one safetensors file (what `load_quantized` reads)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear):
            tensors[f"{name}.qweight"] = layer.qweight.contiguous()
            tensors[f"{name}.scales"] = layer.scales.contiguous()
            tensors[f"{name}.bits"] = torch.tensor([layer.bits], dtype=torch.int32)
            if layer.bits == 4:
                tensors[f"{name}.mins"] = layer.mins.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.replace(path)  # whole or absent: a crash mid-write leaves no half file under the real name


def load_quantized(model: nn.Module, path: Path) -> int:
    """Swap `model`'s linear layers for the groups saved in `path` by `save_quantized`. Returns the
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
    if not names or not names <= linears.keys():
        return 0
    layers = {}
    for name in names:
        child = linears[name][2]
        bits = int(saved[f"{name}.bits"][0])
        qweight, scales = saved[f"{name}.qweight"], saved[f"{name}.scales"]
        if bits not in (4, 8) or qweight.shape != (child.out_features, child.in_features * bits // 8):
            return 0
        layers[name] = QuantizedLinear(qweight, scales, saved.get(f"{name}.mins"), bits, child.bias)
    for name, layer in layers.items():
        parent, attr, _ = linears[name]
        setattr(parent, attr, layer)
    return len(layers)
