"""Model loading: presets (packaged GGUF models), hub ids, local folders and GGUF files."""

from leapdecode.models.linear import SmallBatchLinear, use_small_batch_linear
from leapdecode.models.loading import LoadedModel, default_cache_dir, load_model
from leapdecode.models.presets import DEFAULT_MODEL, PRESETS, Preset, get_preset, pull

__all__ = [
    "DEFAULT_MODEL", "PRESETS", "LoadedModel", "Preset", "SmallBatchLinear", "default_cache_dir", "get_preset", "load_model",
    "pull", "use_small_batch_linear",
]
