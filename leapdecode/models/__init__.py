"""Model loading: presets (packaged GGUF models), hub ids, local folders and GGUF files.

The presets are importable without torch (the command line lists them); the loader and the
linear layers import torch, so they are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from leapdecode.models.presets import DEFAULT_MODEL, PRESETS, Preset, get_preset, pull

if TYPE_CHECKING:
    from leapdecode.models.linear import SmallBatchLinear, use_small_batch_linear
    from leapdecode.models.loading import LoadedModel, default_cache_dir, load_model

_LAZY = {
    "SmallBatchLinear": "leapdecode.models.linear",
    "use_small_batch_linear": "leapdecode.models.linear",
    "LoadedModel": "leapdecode.models.loading",
    "default_cache_dir": "leapdecode.models.loading",
    "load_model": "leapdecode.models.loading",
}

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "LoadedModel",
    "Preset",
    "SmallBatchLinear",
    "default_cache_dir",
    "get_preset",
    "load_model",
    "pull",
    "use_small_batch_linear",
]


def __getattr__(name: str) -> Any:
    """Import the torch-dependent names on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
