"""EAGLE-3 heads on disk, in the formats people publish and engines load.

- EAGLE / SpecForge (what SGLang, vLLM and llama.cpp's converter take): a flat Llama config with
  `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optional `target_hidden_size`
  and `eagle_aux_hidden_state_layer_ids`; weights `fc.*`, `midlayer.*` (or `layers.0.*`),
  `norm.*`, `lm_head.*`, `d2t` (int64 offsets: target = draft + d2t[draft]), `t2d` (bool).
- speculators (`Eagle3Speculator`): `speculators_model_type: "eagle3"`, the layer's config under
  `transformer_layer_config`, `norm_before_residual` (absent: true, as vLLM reads it), the
  verifier under `speculators_config`; weights under `layers.0.*`.

Layer ids are saved as what enters each target layer (vLLM's convention, = Hugging Face's
`hidden_states[i]`); a list whose first id is 1 is read as layer outputs (SGLang's, +1), as SGLang
itself does. An embedding in the checkpoint replaces the target's. What the head does not
implement (several layers, `fc_norm`, `norm_before_fc`) is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leapdecode.errors import ModelLoadError
from leapdecode.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers

FORMATS = ("eagle", "speculators")
# our parameter -> the layer's name in a checkpoint (under `midlayer.` or `layers.0.`)
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    **{f"{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}
TOP_NAMES = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def layer_config(config: Eagle3Config) -> dict[str, Any]:
    """The decoder layer's Llama config, as both formats write it."""
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling}
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        **rope,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def save_eagle3(
    head: Eagle3Head, folder: Path, *, fmt: str = "eagle", target_name: str = "", extra: dict[str, Any] | None = None
) -> Path:
    """Write `head` to `folder` in format `fmt` (one of FORMATS); returns the folder.
    `target_name`: the target's hub id or path, as vLLM reads a speculators verifier."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    c = head.config
    if fmt == "eagle" and c.norm_before_residual:
        raise ValueError(
            "EAGLE's and SGLang's loaders ignore norm_before_residual: save this head in the speculators format"
        )
    prefix = "midlayer." if fmt == "eagle" else "layers.0."
    state = head.state_dict()
    tensors = {name: state[name] for name in TOP_NAMES}
    tensors |= {prefix + theirs: state[ours] for ours, theirs in LAYER_NAMES.items()}
    common: dict[str, Any] = {
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
    }  # layer inputs: vLLM's, llama.cpp's reading
    if c.target_hidden_size != c.hidden_size:  # EAGLE's loader then expects the head's own embedding
        common["target_hidden_size"] = c.target_hidden_size
    if fmt == "eagle":
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer_config(c),
            **common,
            "torch_dtype": str(head.dtype).removeprefix("torch."),
        }
        # SpecForge and older SGLang read eagle_config's ids as layer outputs: there, only when not the default
        config["eagle_config"] = {"use_aux_hidden_state": True}
    else:
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer_config(c),
            **common,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": 3,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {"name_or_path": target_name, "architectures": []},
            },
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps({**config, **(extra or {})}, indent=2) + "\n")
    return folder


def is_eagle3(config: dict[str, Any]) -> bool:
    """Whether a config.json describes an EAGLE-3 head in either format."""
    if config.get("speculators_model_type") == "eagle3":
        return True
    archs = config.get("architectures") or []
    return "LlamaForCausalLMEagle3" in archs or ("draft_vocab_size" in config and config.get("num_hidden_layers") == 1)


def read_config(folder: Path, target: Any) -> Eagle3Config:
    """The head's config from `folder`'s config.json (checked against the target by `load_eagle3`)."""
    raw = json.loads((folder / "config.json").read_text())
    speculators = raw.get("speculators_model_type") == "eagle3"
    layer = (
        {**raw.get("transformer_layer_config", {}), **{k: v for k, v in raw.items() if k != "transformer_layer_config"}}
        if speculators
        else raw
    )
    for unsupported in ("fc_norm", "norm_before_fc"):
        if layer.get(unsupported):
            raise ModelLoadError(f"{folder}: EAGLE-3 heads with {unsupported} are not supported")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"{folder}: an EAGLE-3 head of {layer['num_hidden_layers']} layers; one is supported")
    text = target.config.get_text_config()
    ids = layer.get("eagle_aux_hidden_state_layer_ids") or (layer.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    aux = tuple(int(i) for i in ids) if ids else default_aux_layers(int(text.num_hidden_layers))
    if aux and aux[0] == 1:
        aux = tuple(i + 1 for i in aux)  # layer outputs (SGLang's convention): what enters the next layer
    hidden = int(layer["hidden_size"])
    rope = layer.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ModelLoadError(f"{folder}: per-layer-type rope_parameters are not supported for an EAGLE-3 head")
    scaling = layer.get("rope_scaling") or (
        {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    )
    config = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        vocab_size=int(layer.get("vocab_size") or text.vocab_size),
        draft_vocab_size=int(layer.get("draft_vocab_size") or layer.get("vocab_size") or text.vocab_size),
        aux_layers=aux,
        target_hidden_size=int(layer.get("target_hidden_size") or hidden),
        head_dim=int(layer.get("head_dim") or 0),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=scaling or None,
        max_position_embeddings=int(layer.get("max_position_embeddings", 32768)),
        norm_before_residual=bool(raw.get("norm_before_residual", speculators)),
    )
    return config


def _check_fits(config: Eagle3Config, text: Any, folder: Path, own_embedding: bool) -> None:
    """A head whose sizes or vocabulary do not fit the target: an error naming what differs."""
    differences = []
    if config.target_hidden_size != int(text.hidden_size):
        differences.append(
            f"it reads target states of width {config.target_hidden_size}, the target's hidden size is "
            f"{text.hidden_size}"
        )
    if config.hidden_size != int(text.hidden_size) and not own_embedding:
        differences.append(
            f"its width is {config.hidden_size} and it has no embedding of its own, the target's embedding is "
            f"{text.hidden_size} wide"
        )
    if config.vocab_size != int(text.vocab_size):
        differences.append(f"its vocabulary has {config.vocab_size} tokens, the target's {text.vocab_size}")
    layers = int(text.num_hidden_layers)
    if any(not 0 <= i <= layers for i in config.aux_layers):
        differences.append(f"it reads layers {list(config.aux_layers)}, the target has {layers}")
    if differences:
        raise ModelLoadError(f"the EAGLE-3 head in {folder} does not fit the target: " + "; ".join(differences))


def load_eagle3(folder: Path, target: Any) -> Eagle3Head:
    """Load an EAGLE-3 head (either format) for `target` (a transformers model)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json: not an EAGLE-3 head folder")
    config = read_config(folder, target)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"{folder} has no weights (model.safetensors or pytorch_model.bin)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state |= (
            load_file(str(file))
            if file.suffix == ".safetensors"
            else torch.load(file, map_location="cpu", weights_only=True)
        )
    own = state.pop("embed_tokens.weight", None)
    _check_fits(config, target.config.get_text_config(), folder, own is not None)
    if own is not None and tuple(own.shape) != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(
            f"{folder}: embed_tokens.weight has shape {tuple(own.shape)}, "
            f"the config says {(config.vocab_size, config.hidden_size)}"
        )
    device = target.device
    embed = target.get_input_embeddings() if own is None else nn.Embedding.from_pretrained(own.to(device), freeze=True)
    head = Eagle3Head(config, embed)
    try:
        head.load_state_dict(_our_names(state, config, folder))
    except RuntimeError as exc:  # a tensor whose shape the config does not give
        raise ModelLoadError(
            f"{folder}: the weights do not fit the config: {str(exc).splitlines()[-1].strip()}"
        ) from exc
    return head.to(device).eval()


def _our_names(state: dict[str, torch.Tensor], config: Eagle3Config, folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under our parameter names; d2t/t2d made up when the draft
    vocabulary is the whole vocabulary (engines then leave them out)."""
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in state) else "layers.0."
    ours: dict[str, torch.Tensor] = {}
    for name, theirs in LAYER_NAMES.items():
        if prefix + theirs not in state:
            raise ModelLoadError(f"{folder}: the checkpoint lacks {prefix + theirs}")
        ours[name] = state[prefix + theirs]
    for name in TOP_NAMES:
        if name in state:
            ours[name] = state[name]
        elif name == "d2t":
            ours[name] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        elif name == "t2d":
            ours[name] = torch.arange(config.vocab_size) < config.draft_vocab_size
        else:
            raise ModelLoadError(f"{folder}: the checkpoint lacks {name}")
    expected = {
        "fc.weight": (config.hidden_size, config.feature_size),
        "lm_head.weight": (config.draft_vocab_size, config.hidden_size),
    }
    for name, shape in expected.items():
        if tuple(ours[name].shape) != shape:
            raise ModelLoadError(f"{folder}: {name} has shape {tuple(ours[name].shape)}, the config says {shape}")
    ours["d2t"], ours["t2d"] = ours["d2t"].long(), ours["t2d"].bool()
    targets = torch.arange(config.draft_vocab_size) + ours["d2t"]
    if (
        ours["d2t"].shape != (config.draft_vocab_size,)
        or targets.min() < 0
        or targets.max() >= config.vocab_size
        or targets.unique().numel() != len(targets)
    ):
        raise ModelLoadError(
            f"{folder}: d2t does not map the {config.draft_vocab_size} draft tokens to distinct target ids below "
            f"{config.vocab_size} (offsets expected: target = draft + d2t[draft])"
        )
    return ours
