"""How results name a method: its string with only the parameters that differ from the method's
defaults, so that a table row says what was chosen rather than repeating every default.

Samples keep the full method string (`Entry.label`), which stays the key of every result; the
short label is for people (tables, plots, the README). Both name one method: parsing the short
label gives the same method back, so two entries with different strings keep different labels.
"""

from __future__ import annotations

import dataclasses

from leapdecode.errors import MethodError
from leapdecode.methods import Autoregressive, Method, parse_method

LLAMACPP_PLAIN = "llama.cpp plain"  # this engine's plain decoding with llama.cpp computing the passes


def method_of(label: str) -> Method | None:
    """The method a result's label names (any `@VARIANT` dropped); None for a string that no
    longer parses (a run recorded before a method or parameter was renamed)."""
    spec = label.rpartition("@")[0] if "@" in label else label
    try:
        return parse_method(spec)
    except MethodError:
        return None


def is_peer(label: str) -> bool:
    """Whether a result comes from a peer (another library's generator): its plain decoding has
    that library's numerics, so a difference from ours is the peer's, not a lossless failure."""
    method = method_of(label)
    return method is not None and method.capabilities.peer


def short_method(method: Method) -> str:
    """`name[:param=value,...]` with only the parameters whose value is not the class's default;
    a parameter without a default is always written."""
    params = []
    for f in dataclasses.fields(method):
        value = getattr(method, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            params.append(f"{f.name}={value}")
            continue
        if value != default:
            params.append(f"{f.name}={value}")
    return f"{method.name}:{','.join(params)}" if params else method.name


def short_label(label: str, backend: str = "torch") -> str:
    """A result's label for tables and plots: `hybrid:k=8,...,cost_aware=True@int4` -> `hybrid@int4`.
    Plain decoding on llama.cpp (`ar` in a run whose backend is llama.cpp, or `ar@llama.cpp`) is
    named for what it is: `ar` alone always means this engine's plain decoding on PyTorch."""
    _, at, variant = label.rpartition("@") if "@" in label else (label, "", "")
    method = method_of(label)
    if method is None:
        return label
    if isinstance(method, Autoregressive) and (variant or backend) == "llama.cpp":
        return LLAMACPP_PLAIN
    return f"{short_method(method)}{at}{variant}"


def variant_backend(variant: str) -> str:
    """The backend a model variant (`X` in `anpd@X`) runs on: a variant names llama.cpp or runs
    on PyTorch, the only backend that takes a dtype or a quantization."""
    return "llama.cpp" if "llama.cpp" in variant.split("+") else "torch"


def run_backend(meta: dict[str, object]) -> str:
    """The backend a run's own model ran on: `backend` in its meta, else read from `weights`
    (`llama.cpp gguf`); torch when neither says."""
    backend = meta.get("backend")
    if isinstance(backend, str) and backend:
        return backend
    weights = str(meta.get("weights") or "")
    return "llama.cpp" if weights.startswith("llama.cpp") else "torch"
