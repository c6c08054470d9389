"""An empty model filled tensor by tensor: what both loaders that never hold a float model whole
(`gguf_model`, `checkpoint_stream`) build on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leapdecode.errors import ModelLoadError


def empty_model(config: Any, dtype: torch.dtype) -> Any:
    """`config`'s causal LM with every parameter on the meta device (`accelerate.init_empty_weights`;
    buffers such as the rotary frequencies computed as usual): nothing the size of the weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from leapdecode.models.gguf_folder import quiet_progress

    with init_empty_weights(include_buffers=False), quiet_progress():
        try:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as exc:
            raise ModelLoadError(f"a {type(config).__name__} model is not a causal language model") from exc


def place(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    """`value` as `module`'s parameter (frozen) or buffer `attr`, replacing its meta placeholder."""
    if attr in module._parameters:
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    else:
        module.register_buffer(attr, value)


def swap(model: nn.Module, name: str, layer: nn.Module) -> None:
    """Replace `model`'s submodule `name` with `layer`."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, layer)
