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
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leapdecode.models.extensions import build
from leapdecode.models.packing import BODY, pack, pack_super, packed_shape, unpack, unpack_super
from leapdecode.models.rounding import GROUP, SuperScales, dequantize, quantize_weight_super

logger = logging.getLogger("leapdecode")

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

    def rows(self, ids: torch.Tensor) -> QuantizedLinear:
        """The layer restricted to the outputs `ids` [V']: their own records (the same integers
        and factors), so each output is bitwise this layer's."""
        bias = None if self.bias is None else self.bias[ids]
        if self.super_blocks:
            qweight, factors = unpack_super(self.packed, self.bits, self.out_features, self.in_features // GROUP)
            return QuantizedLinear.from_groups(qweight[ids], factors.rows(ids), None, self.bits, bias)
        qweight, scales, mins = self.groups()
        kept_mins = None if mins is None else mins[ids]
        return QuantizedLinear.from_groups(qweight[ids], scales[ids], kept_mins, self.bits, bias)

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


def huge_page_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """Uninitialized uint8 memory of `shape` in huge pages (where the kernel builds), for a layer
    filled in place: the copy reads a fresh, never-written buffer, whose pages are the kernel's
    shared zero page, so only the destination becomes resident."""
    return _in_huge_pages(torch.empty(shape, dtype=torch.uint8))


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
    # a name of its own (two processes may write the same file) replaced whole: a crash mid-write
    # leaves no half file under the real name
    handle, name = tempfile.mkstemp(prefix=path.name, suffix=".partial", dir=path.parent)
    os.close(handle)
    partial = Path(name)
    try:
        save_file(tensors, name)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


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


def quantize_through_cache(
    model: nn.Module, saved: Path, stale: str, quantize: Callable[[bool], int], log: Callable[[str], None]
) -> bool:
    """Quantize `model`'s linear layers through the cache file `saved`, which spares the minute a
    GGUF's blocks take to match or the seconds a rounding takes: read back what the file holds,
    then `quantize(read_back)` swaps the layers still float (all of them without the file) and
    says how many. When it swapped any, every layer's records are written to `saved` and older
    files in its folder matching the glob `stale` removed; a failed write is logged, as the cache
    only saves time. True when every layer came from the file."""
    from safetensors import SafetensorError

    read_back = saved.is_file() and load_quantized(model, saved) > 0
    if not quantize(read_back) and read_back:
        return True
    try:
        save_quantized(model, saved)
    except (OSError, SafetensorError) as exc:
        log(f"could not keep the quantized layers in {saved} ({exc})")
        return False
    log(f"saved the quantized layers in {saved}")
    for old in saved.parent.glob(stale):
        if old != saved:
            old.unlink(missing_ok=True)
    return False
