"""What a model runs in: one pure function from (source, hardware, the user's choices) to a
dtype and a quantization, used by `load_model` and so by every command.

Without a choice (`dtype="auto"`, `quantize="auto"`) a model runs as it was shipped, on the
fastest path the hardware has for it:
- a GGUF file with quantized blocks runs its own blocks in the packed CPU kernel (what llama.cpp
  runs: the file's model, not a second rounding of it);
- a checkpoint (a Hugging Face folder or hub id, or a GGUF of float tensors) runs in its own dtype
  where the hardware computes it natively (Hugging Face's `dtype="auto"`), else in float32:
  on a CPU without native bf16 products bfloat16 is emulated and slower than float32.
Quantizing a float checkpoint stays a choice. `dtype=X` alone means X, not quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from leapdecode.errors import ModelLoadError

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")
# GGUF tensor types stored as floats: a file of only these is a checkpoint like any other.
FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass(frozen=True)
class Hardware:
    """What the target device computes natively (bf16/fp16 products), and whether it is a CPU
    (the quantized kernels run on CPU only)."""

    device: Literal["cpu", "cuda", "mps", "other"]
    native_bf16: bool
    native_fp16: bool

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class Source:
    """What a model spec turned out to be: `gguf_quantized` for a GGUF file whose weights are
    stored in quantized blocks; `dtype` the checkpoint's own dtype name, where it says one."""

    gguf_quantized: bool = False
    dtype: str | None = None


@dataclass(frozen=True)
class Precision:
    """The resolution: what the weights compute in, their quantization, and why (for `describe`)."""

    dtype: str  # float32, bfloat16 or float16
    quantize: str  # none, int8 or int4 (int4 from a GGUF: the file's own blocks, see quantize.py)
    reason: str


def dtype_name(dtype: object) -> str:
    """`torch.bfloat16` or "BFloat16" -> "bfloat16"; checked against DTYPE_NAMES."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return name


def check_choices(dtype: object, quantize: str | None, backend: str, hardware: Hardware) -> tuple[str, str]:
    """Refuse a choice that cannot run, before anything is loaded; returns (dtype, quantize) names."""
    name = dtype_name(dtype)
    mode = (quantize or "auto").strip().lower()
    if mode not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    if mode in ("int8", "int4"):
        if backend == "llama.cpp":
            raise ModelLoadError(
                "the llama.cpp backend runs the GGUF's own quantization; quantize is for the torch backend"
            )
        if not hardware.cpu:
            raise ModelLoadError(f"quantized layers run on CPU, not {hardware.device}")
        if name not in ("auto", "float32"):
            raise ModelLoadError(f"quantized layers compute in float32; drop dtype={name} or quantize")
    return name, mode


def resolve_precision(
    source: Source, hardware: Hardware, dtype: object = "auto", quantize: str | None = "auto", backend: str = "torch"
) -> Precision:
    """What runs for `source` on `hardware` given the user's choices (see the module's docstring)."""
    name, mode = check_choices(dtype, quantize, backend, hardware)
    if backend == "llama.cpp":
        return Precision("float32", "none", "llama.cpp runs the GGUF's own types")
    if mode in ("int8", "int4"):
        return Precision("float32", mode, f"{mode} asked for")
    if name != "auto":
        return Precision(name, "none", f"{name} asked for")
    if mode == "auto" and source.gguf_quantized and hardware.cpu:
        return Precision("float32", "int4", "the GGUF's own blocks")
    own = source.dtype if source.dtype in ("bfloat16", "float16") and not source.gguf_quantized else "float32"
    if own == "bfloat16" and hardware.native_bf16:
        return Precision("bfloat16", "none", "the checkpoint's bfloat16, native here")
    if own == "float16" and hardware.native_fp16:
        return Precision("float16", "none", "the checkpoint's float16, native here")
    if own != "float32":
        return Precision("float32", "none", f"float32: {own} is not native on {hardware.device}")
    return Precision("float32", "none", "de-quantized GGUF" if source.gguf_quantized else "the checkpoint's float32")


def gguf_is_quantized(path: Path) -> bool:
    """Whether a GGUF file stores any weight matrix in quantized blocks (reads only its tensor table)."""
    from gguf import GGMLQuantizationType

    from leapdecode.models.gguf_header import GGUFHeaderError, read_tensor_infos

    try:
        infos = read_tensor_infos(path)
    except (GGUFHeaderError, OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read GGUF {path}: {exc} (corrupt file?)") from exc
    float_ids = {GGMLQuantizationType[name].value for name in FLOAT_GGUF_TYPES}
    return any(t.type_id not in float_ids for t in infos if len(t.shape) >= 2)


def checkpoint_dtype(config: object) -> str | None:
    """A transformers config's own dtype name, if it has one (transformers reads an older config's
    `torch_dtype` into `dtype`; the old name itself warns)."""
    value = getattr(config, "dtype", None)
    if value is None:
        return None
    name = str(value).strip().lower().removeprefix("torch.")
    return name if name in DTYPE_NAMES[1:] else None
