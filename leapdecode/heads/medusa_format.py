"""The two formats Medusa heads are published in: reading (`load_medusa`, checked against the
target) and writing (`save_medusa`).

Formats (`load_medusa` tells them apart by config.json):
- Medusa's own (FasterDecoding/Medusa): `medusa_num_heads`, `medusa_num_layers`,
  `base_model_name_or_path`; weights `medusa_lm_head.safetensors` or `.pt`, an `nn.ModuleList`
  of `nn.Sequential(*[ResBlock] * num_layers, Linear(H, V, bias=False))`: keys
  `{i}.{j}.linear.weight|bias` and `{i}.{num_layers}.weight`. Medusa's code builds a head's
  layers from ONE shared ResBlock (`[ResBlock] * n`); here they are kept apart, as TensorRT-LLM
  and vLLM read them, which is the same whenever num_layers is 1 (every published head).
- vLLM's (`model_type: "medusa"`, `architectures: ["MedusaModel"]`, `num_heads`,
  `num_hidden_layers`): weights `model.safetensors` with `blocks.{i}.layers.{j}.weight` (and
  `.bias` when `medusa_fc_bias`), `lm_heads.{i}.weight`; `original_lm_head: true` shares one
  `lm_head.weight` across heads; `truncated_vocab_size` < `vocab_size` with a `token_map` tensor
  makes the heads score only those tokens (the rest get -inf), as vLLM does.
Heads whose weights carry no LM head use the target's own (`MedusaHeads.lm_heads` is None).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from leapdecode.errors import ModelLoadError
from leapdecode.heads.medusa import MedusaConfig, MedusaHeads, target_output_weight

MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
FORMATS = ("medusa", "vllm")
_EXPECTED = (
    "Medusa's config (medusa_num_heads, medusa_num_layers) or vLLM's Medusa config "
    "(model_type 'medusa' or architectures ['MedusaModel'], num_heads, num_hidden_layers)"
)


# --- saving ---------------------------------------------------------------------------


def save_medusa(
    heads: MedusaHeads,
    folder: str | Path,
    *,
    format: str = "medusa",
    base_model: str = "",
    safetensors: bool = True,
) -> Path:
    """Write `heads` to `folder` (created) in Medusa's format or vLLM's; `safetensors=False`
    writes Medusa's original `medusa_lm_head.pt` (vLLM's: `pytorch_model.bin`). Shared-LM-head
    heads: Medusa's format leaves the LM heads out (Medusa's own loader starts them from the
    base model's); vLLM's stores the shared weight once (`original_lm_head`), as vLLM reads it
    from the draft's file. Returns the weights file."""
    if format not in FORMATS:
        raise ValueError(f"unknown Medusa format {format!r}; choose one of {FORMATS}")
    if format == "medusa" and heads.token_map is not None:
        raise ValueError("Medusa's format has no token map: save heads with a truncated vocabulary with format='vllm'")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    c = heads.config
    if format == "medusa":
        config: dict[str, Any] = {
            "medusa_num_heads": c.num_heads,
            "medusa_num_layers": c.num_layers,
            "base_model_name_or_path": base_model,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
        }
        state = _to_medusa_names(heads)
    else:
        config = {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "num_heads": c.num_heads,
            "num_hidden_layers": c.num_layers,
            "medusa_fc_bias": True,
        }
        if base_model:
            config["base_model_name_or_path"] = base_model
        state = dict(heads.state_dict())
        if heads.token_map is not None:
            config["truncated_vocab_size"] = int(heads.token_map.numel())
        if heads.shared_lm_head is not None:
            config["original_lm_head"] = True
            state["lm_head.weight"] = heads.shared_lm_head
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = MEDUSA_WEIGHTS if format == "medusa" else VLLM_WEIGHTS
    target = path / names[0 if safetensors else 1]
    tensors = {key: value.detach().contiguous() for key, value in state.items()}
    if safetensors:
        save_file(tensors, str(target), metadata={"format": "pt"})
    else:
        torch.save(tensors, target)
    return target


def _to_medusa_names(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """The heads' tensors under Medusa's `nn.ModuleList` of `nn.Sequential` names."""
    state: dict[str, torch.Tensor] = {}
    for i, block in enumerate(heads.blocks):
        for j, layer in enumerate(block.layers):
            state[f"{i}.{j}.linear.weight"] = layer.weight
            state[f"{i}.{j}.linear.bias"] = layer.bias
        if heads.lm_heads is not None:
            state[f"{i}.{heads.config.num_layers}.weight"] = heads.lm_heads[i].weight
    return state


# --- loading --------------------------------------------------------------------------


@dataclass
class _Read:
    """What a format's reader found: tensors under the heads' own names, and the shape."""

    num_heads: int
    num_layers: int
    state: dict[str, torch.Tensor]
    shared: torch.Tensor | None  # a stored shared LM head (vLLM's original_lm_head)
    hidden_size: int | None  # as config.json says, if it does
    vocab_size: int | None


def load_medusa(folder: str | Path, target_model: Any, *, dtype: torch.dtype | None = torch.float32) -> MedusaHeads:
    """Medusa heads from `folder` (either format), checked against the target's hidden size and
    vocabulary; heads without LM heads take the target's. `dtype`: None keeps the stored one."""
    path = Path(folder)
    config = _read_config(path)
    if config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or ()):
        read = _read_vllm(path, config)
    elif "medusa_num_heads" in config:
        read = _read_medusa(path, config)
    else:
        raise ModelLoadError(f"{path / 'config.json'} is not a Medusa config: expected {_EXPECTED}")
    heads = _assemble(path, read, target_model)
    return (heads if dtype is None else heads.to(dtype)).eval()


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ModelLoadError(f"Medusa heads folder {path} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json: expected {_EXPECTED}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not read {file}: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file} is not a JSON object: expected {_EXPECTED}")
    return config


def _read_weights(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The first of `names` in `path`: safetensors, or a torch file (weights only)."""
    file = next((path / name for name in names if (path / name).is_file()), None)
    if file is None:
        raise ModelLoadError(f"no Medusa weights in {path}: expected {' or '.join(names)}")
    try:
        if file.suffix == ".safetensors":
            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as error:
        raise ModelLoadError(f"could not read {file}: {error}") from error
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{file} does not hold a dictionary of tensors")
    return state


def _count(config: dict[str, Any], keys: tuple[str, ...], default: int | None, path: Path, least: int) -> int:
    """An integer setting from config.json, under the first of `keys` it has."""
    value = next((config[key] for key in keys if key in config), default)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ModelLoadError(f"{path / 'config.json'}: {keys[0]} must be an integer >= {least}, got {value!r}")
    return value


def _read_medusa(path: Path, config: dict[str, Any]) -> _Read:
    num_heads = _count(config, ("medusa_num_heads",), None, path, 1)
    num_layers = _count(config, ("medusa_num_layers",), 1, path, 0)
    raw = {key.removeprefix("medusa_head."): value for key, value in _read_weights(path, MEDUSA_WEIGHTS).items()}
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for i in range(num_heads):
        for j in range(num_layers):
            for part in ("weight", "bias"):
                key = f"{i}.{j}.linear.{part}"
                if key in raw:
                    state[f"blocks.{i}.layers.{j}.{part}"] = raw[key]
                else:
                    missing.append(key)
    lm = [f"{i}.{num_layers}.weight" for i in range(num_heads)]
    if any(key in raw for key in lm):  # none: the shared-LM-head variant
        missing += [key for key in lm if key not in raw]
        state.update({f"lm_heads.{i}.weight": raw[key] for i, key in enumerate(lm) if key in raw})
    _no_missing(path, missing, f"{num_heads} heads of {num_layers} layers in Medusa's format")
    return _Read(num_heads, num_layers, state, None, config.get("hidden_size"), config.get("vocab_size"))


def _read_vllm(path: Path, config: dict[str, Any]) -> _Read:
    num_heads = _count(config, ("num_heads", "medusa_num_heads"), None, path, 1)
    num_layers = _count(config, ("num_hidden_layers", "medusa_num_layers"), 1, path, 0)
    raw = {key.removeprefix("medusa_heads."): value for key, value in _read_weights(path, VLLM_WEIGHTS).items()}
    bias = bool(config.get("medusa_fc_bias", False))  # vLLM reads biases only then
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for i in range(num_heads):
        for j in range(num_layers):
            key = f"blocks.{i}.layers.{j}"
            if f"{key}.weight" not in raw or (bias and f"{key}.bias" not in raw):
                missing.append(f"{key}.weight" if f"{key}.weight" not in raw else f"{key}.bias")
                continue
            weight = raw[f"{key}.weight"]  # [H, H]
            state[f"{key}.weight"] = weight
            state[f"{key}.bias"] = raw[f"{key}.bias"] if bias else weight.new_zeros(weight.shape[0])
    vocab, truncated = config.get("vocab_size"), config.get("truncated_vocab_size")
    if isinstance(truncated, int) and isinstance(vocab, int) and truncated < vocab:
        if "token_map" not in raw:
            missing.append("token_map (config.json has truncated_vocab_size < vocab_size)")
        else:
            state["token_map"] = raw["token_map"].to(torch.long)
    shared = None
    if config.get("original_lm_head", False):
        shared = raw.get("lm_head.weight", raw.get("lm_heads.0.weight"))  # None: the target's
    elif any(f"lm_heads.{i}.weight" in raw for i in range(num_heads)):
        for i in range(num_heads):
            if f"lm_heads.{i}.weight" in raw:
                state[f"lm_heads.{i}.weight"] = raw[f"lm_heads.{i}.weight"]
            else:
                missing.append(f"lm_heads.{i}.weight")
    _no_missing(path, missing, f"{num_heads} heads of {num_layers} layers in vLLM's Medusa format")
    return _Read(num_heads, num_layers, state, shared, config.get("hidden_size"), vocab)


def _no_missing(path: Path, missing: list[str], what: str) -> None:
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ModelLoadError(f"the weights in {path} lack {', '.join(missing[:4])}{more} (config.json: {what})")


def _infer_hidden(read: _Read, target_hidden: int) -> int:
    """The heads' hidden size, from the weights (config.json, else the target's, when they hold none)."""
    for key in ("blocks.0.layers.0.weight", "lm_heads.0.weight"):
        if key in read.state:
            return int(read.state[key].shape[1])
    if read.shared is not None:
        return int(read.shared.shape[1])
    return read.hidden_size if isinstance(read.hidden_size, int) else target_hidden


def _check_sizes(path: Path, read: _Read, hidden: int, vocab: int, text: Any) -> None:
    """The weights agree with config.json, and both with the target."""
    for name, said, found in (("hidden size", read.hidden_size, hidden), ("vocabulary size", read.vocab_size, vocab)):
        if said is not None and said != found:
            raise ModelLoadError(f"{path / 'config.json'} says {name} {said}, but the weights have {found}")
    if hidden != text.hidden_size:
        raise ModelLoadError(
            f"Medusa heads for hidden size {hidden}, but the target's hidden size is {text.hidden_size}"
        )
    if vocab != text.vocab_size:
        raise ModelLoadError(
            f"Medusa heads for a vocabulary of {vocab} tokens, but the target's vocabulary has {text.vocab_size}"
        )


def _assemble(path: Path, read: _Read, target_model: Any) -> MedusaHeads:
    """Check the weights against config.json and the target, then build the heads on them."""
    text = target_model.config.get_text_config()
    hidden = _infer_hidden(read, text.hidden_size)
    token_map = read.state.pop("token_map", None)  # [rows]
    lm = read.state.get("lm_heads.0.weight", read.shared)  # [rows or vocab, H]
    vocab = read.vocab_size if token_map is not None or lm is None else int(lm.shape[0])
    vocab = text.vocab_size if vocab is None else vocab
    _check_sizes(path, read, hidden, vocab, text)
    shared = read.shared
    if lm is None:  # the heads use the target's own LM head
        shared = target_output_weight(target_model)  # [V, H]
        if shared is None:
            raise ModelLoadError(
                f"the Medusa heads in {path} use the target's LM head, and the target's could not be read as weights"
            )
    if token_map is not None:  # full-vocabulary LM heads: keep the map's rows, as vLLM does
        for key in [k for k in read.state if k.startswith("lm_heads.")]:
            if read.state[key].shape[0] > token_map.numel():
                read.state[key] = read.state[key][token_map]
        if shared is not None and shared.shape[0] > token_map.numel():
            shared = shared[token_map]
    config = MedusaConfig(hidden, vocab, read.num_heads, read.num_layers)
    try:
        with torch.device("meta"):  # no memory for weights about to be replaced
            heads = MedusaHeads(
                config, token_map=token_map, shared_lm_head=None if shared is None else shared.to("meta")
            )
    except ValueError as error:
        raise ModelLoadError(f"the LM head for the Medusa heads in {path}: {error}") from error
    for key, value in heads.state_dict().items():
        if key == "token_map":
            continue
        if key not in read.state:
            raise ModelLoadError(f"the weights in {path} lack {key}")
        if read.state[key].shape != value.shape:
            raise ModelLoadError(
                f"{key} in {path} has shape {tuple(read.state[key].shape)}, expected {tuple(value.shape)}"
            )
    heads.load_state_dict(read.state, strict=False, assign=True)
    heads.shared_lm_head = None if shared is None else shared.detach()
    return heads
