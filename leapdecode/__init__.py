"""leapdecode: lossless accelerated generation for causal language models.

Load a model, wrap it with a method, generate the same text faster:

    import leapdecode
    lm = leapdecode.load_model("smollm2-135m")
    out = leapdecode.wrap(lm, "anpd:n=5,k=7").generate("def fib(n):", max_new_tokens=128)

The names below are imported on first use, so that `import leapdecode` (and the command line's
`--help`) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from leapdecode.errors import InputError, LeapDecodeError, MethodError, ModelLoadError

if TYPE_CHECKING:
    from leapdecode.api import Decoder, GenerationResult, encode_prompt, generate, wrap
    from leapdecode.engine import GenerationStats, Step
    from leapdecode.methods import METHODS, Method, parse_method
    from leapdecode.models import PRESETS, LoadedModel, load_model

__version__ = "0.1.0"

_LAZY = {
    "Decoder": "leapdecode.api",
    "GenerationResult": "leapdecode.api",
    "encode_prompt": "leapdecode.api",
    "generate": "leapdecode.api",
    "wrap": "leapdecode.api",
    "GenerationStats": "leapdecode.engine",
    "Step": "leapdecode.engine",
    "METHODS": "leapdecode.methods",
    "Method": "leapdecode.methods",
    "parse_method": "leapdecode.methods",
    "PRESETS": "leapdecode.models",
    "LoadedModel": "leapdecode.models",
    "load_model": "leapdecode.models",
}

__all__ = [
    "METHODS",
    "PRESETS",
    "Decoder",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "LeapDecodeError",
    "LoadedModel",
    "Method",
    "MethodError",
    "ModelLoadError",
    "Step",
    "encode_prompt",
    "generate",
    "load_model",
    "parse_method",
    "wrap",
]


def __getattr__(name: str) -> Any:
    """Import the public names on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
