"""leapdecode: lossless accelerated generation for causal language models.

Load a model, wrap it with a method, generate the same text faster:

    import leapdecode
    lm = leapdecode.load_model("smollm2-135m")
    out = leapdecode.wrap(lm, "anpd:n=5,k=7").generate("def fib(n):", max_new_tokens=128)
"""

from leapdecode.api import Decoder, GenerationResult, encode_prompt, generate, wrap
from leapdecode.engine import GenerationStats, Step
from leapdecode.errors import InputError, LeapDecodeError, MethodError, ModelLoadError
from leapdecode.methods import METHODS, Method, parse_method
from leapdecode.models import PRESETS, LoadedModel, load_model

__version__ = "0.1.0"

__all__ = [
    "METHODS", "PRESETS", "Decoder", "GenerationResult", "GenerationStats", "InputError", "LeapDecodeError",
    "LoadedModel", "Method", "MethodError", "ModelLoadError", "Step", "encode_prompt", "generate", "load_model",
    "parse_method", "wrap",
]
