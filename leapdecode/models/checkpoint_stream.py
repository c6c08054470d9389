"""A local Hugging Face checkpoint quantized as it is read: one tensor at a time into an empty model.

Why: `from_pretrained` then `quantize_model` holds the whole float32 model and then its quantized
copy, about five bytes a parameter at the peak. Here the model is built empty
(`accelerate.init_empty_weights`), each linear weight read from the folder's safetensors files is
rounded into its quantized layer at once, and the rest placed as floats, so the peak is about
the quantized model plus one float tensor. The layers are the ones `quantize_model` gives (the
same rounding of the same float32 values, the output layer at int8, layers whose input is not
a multiple of 32 kept float). A folder this cannot take as it is (no safetensors, or names that
transformers would rename on load) is left to `from_pretrained`: `None`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leapdecode.models.empty_model import empty_model, place, swap
from leapdecode.models.quantize import BITS, QuantizedLinear
from leapdecode.models.rounding import GROUP


def checkpoint_files(source: str) -> list[Path]:
    """The folder's safetensors files (none: not a local folder of them)."""
    folder = Path(source)
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def load_quantized_checkpoint(source: str, config: Any, mode: str, log: Callable[[str], None]) -> Any | None:
    """The model of a local folder with its linear layers quantized to `mode` ("int8", "int4") as
    they are read; None where the folder's tensor names are not the model's own."""
    from safetensors import safe_open
    from transformers import GenerationConfig

    files = checkpoint_files(source)
    model = empty_model(config, torch.float32)
    expected = set(model.state_dict())
    where = {key: path for path in files for key in safe_open(str(path), framework="pt").keys()}
    if not where or not set(where) <= expected:
        return None
    log(f"reading {source} tensor by tensor, quantizing the linear layers to {mode} as they come")
    linears = {}
    with torch.no_grad():
        for key, path in where.items():
            module_name, _, attr = key.rpartition(".")
            module = model.get_submodule(module_name)
            if isinstance(module, nn.Linear) and attr == "weight" and not module.in_features % GROUP:
                linears[module_name] = path
                continue
            place(module, attr, _read(path, key))
        model.tie_weights()  # an output layer saved as the embeddings': theirs, before it is quantized
        head = model.get_output_embeddings()
        for name, path in linears.items():
            swap(model, name, _quantized(model.get_submodule(name), _read(path, f"{name}.weight"), head, mode))
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and not module.in_features % GROUP and not module.weight.is_meta:
                swap(model, name, _quantized(module, module.weight, head, mode))  # tied: not in the files
    if any(p.is_meta for p in [*model.parameters(), *model.buffers()]):
        return None
    if (Path(source) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    return model.eval()


def _read(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensor = handle.get_tensor(key)
    return tensor.float() if tensor.is_floating_point() else tensor


def _quantized(linear: nn.Linear, weight: torch.Tensor, head: nn.Module | None, mode: str) -> QuantizedLinear:
    bias = None if linear.bias is None or linear.bias.is_meta else linear.bias.detach()
    return QuantizedLinear.from_weight(weight, 8 if linear is head else BITS[mode], bias)
