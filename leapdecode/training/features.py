"""What a head learns from: the target's own states and distributions over training text.

One target pass per example (no cache, the whole sequence at once) gives the states a head reads
(`layers`, indices into Hugging Face's `hidden_states`) and, per position, the target's
distribution over the next token, kept as its `TOP_K` most probable tokens (ids in the draft
vocabulary, -1 outside it; probabilities renormalised over those kept): the head is trained
against the target, not against the text. Examples are cached on disk (safetensors, one file
each) up to a size bound, so later epochs and a resumed run skip the target's pass.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TOP_K = 16  # target probabilities kept per position


@dataclass(frozen=True)
class Example:
    """One training sequence with what the target says about it.

    input_ids [T]; loss_mask [T] (True where the token is answer text); states [T, F]; label_ids
    [T, TOP_K] draft ids of the target's most probable next tokens at each position (-1: outside
    the draft vocabulary); label_probs [T, TOP_K] their probabilities, renormalised."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    states: torch.Tensor
    label_ids: torch.Tensor
    label_probs: torch.Tensor

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {
            k: getattr(self, k).contiguous() for k in ("input_ids", "loss_mask", "states", "label_ids", "label_probs")
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Example:
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


@torch.inference_mode()
def target_example(
    model: Any,
    input_ids: list[int],
    loss_mask: list[bool],
    layers: tuple[int, ...],
    to_draft: torch.Tensor,
    *,
    state_dtype: torch.dtype = torch.bfloat16,
) -> Example:
    """Run the target once over `input_ids` and keep what training needs (see `Example`)."""
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)  # [1, T]
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    states = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1).to(state_dtype)  # [T, F]
    probs = out.logits[0].float().softmax(-1)  # [T, vocab]
    top = probs.topk(TOP_K, dim=-1)  # [T, K]
    label_ids = to_draft.to(top.indices.device)[top.indices]  # [T, K], -1 outside
    kept = top.values * (label_ids >= 0)
    label_probs = kept / kept.sum(-1, keepdim=True).clamp_min(1e-9)
    return Example(
        ids[0].cpu(),
        torch.tensor(loss_mask, dtype=torch.bool),
        states.cpu(),
        label_ids.to(torch.int32).cpu(),
        label_probs.to(torch.float16).cpu(),
    )


class FeatureCache:
    """Examples on disk under `folder`, keyed by the target, the layers and the example's tokens;
    stops storing (but still serves what it holds) past `max_bytes`."""

    def __init__(self, folder: Path, key: dict[str, Any], max_bytes: int) -> None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = folder / digest
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "key.json").write_text(json.dumps(key, indent=2, sort_keys=True))
        self.max_bytes = max_bytes
        self.used = sum(p.stat().st_size for p in self.folder.glob("*.safetensors"))

    def path(self, input_ids: list[int]) -> Path:
        return self.folder / (hashlib.sha256(json.dumps(input_ids).encode()).hexdigest()[:24] + ".safetensors")

    def get(self, input_ids: list[int]) -> Example | None:
        path = self.path(input_ids)
        return Example.load(path) if path.is_file() else None

    def put(self, example: Example) -> None:
        if self.used >= self.max_bytes:
            return
        path = self.path(example.input_ids.tolist())
        example.save(path)
        self.used += path.stat().st_size
