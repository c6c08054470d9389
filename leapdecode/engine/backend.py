"""The model side of the decode loop: score tokens over a KV cache, and cut the cache back.

A backend is stateless with respect to sequences: `prefill` returns a `Sequence` that owns
its KV cache, and every later call takes it. Nothing is stored on the model object, so one
loaded model can serve several sequences one after another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from leapdecode.engine.tree import TreeLayout, TreeMaskBuffer


@dataclass
class Sequence:
    """One sequence's KV cache. `length` is how many tokens the cache holds."""

    cache: Any
    length: int
    tree_mask: TreeMaskBuffer = field(default_factory=TreeMaskBuffer)  # reused by every tree pass


@dataclass(frozen=True)
class Scores:
    """What one forward pass returns."""

    logits: torch.Tensor  # [n, vocab]: logits[i] predicts the token after input i
    hidden: torch.Tensor | None = None  # [n, hidden] last-layer states, when asked for


class Backend(Protocol):
    """What the decode loop needs from a model."""

    vocab_size: int
    device: torch.device

    def prefill(self, prompt_ids: list[int]) -> tuple[Sequence, Scores]:
        """Run the prompt; return its cache and the scores of the last prompt position only."""
        ...

    def forward(self, seq: Sequence, token_ids: list[int], *, hidden: bool = False, tree: TreeLayout | None = None) -> Scores:
        """Append `token_ids` to the cache and score every one of them; with `tree`, the tokens
        are a tree's nodes (root first) and each attends only to its own path."""
        ...

    def rollback(self, seq: Sequence, length: int) -> None:
        """Cut the cache back to its first `length` tokens (drop rejected drafts)."""
        ...

    def keep(self, seq: Sequence, start: int, nodes: list[int]) -> None:
        """Keep the cache entries at `start + i` for i in `nodes` (in order) right after the first
        `start` tokens, and drop everything else after `start` (an accepted tree path)."""
        ...


class TorchBackend:
    """A `transformers` causal LM, driven only through its public forward and cache objects."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device: torch.device = model.device
        self.vocab_size: int = int(model.config.get_text_config().vocab_size)

    def _run(
        self, seq: Sequence, token_ids: list[int], logits_to_keep: int, hidden: bool, tree: TreeLayout | None = None,
    ) -> Scores:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        extra: dict[str, Any] = {}
        if tree is not None and not tree.is_chain:
            extra["attention_mask"] = seq.tree_mask.mask(tree, seq.length, self.model.dtype, self.device)  # [1, 1, n, past+n]
            extra["position_ids"] = (seq.length + tree.depth_on(self.device))[None]  # [1, n]
        out = self.model(
            input_ids=input_ids,
            past_key_values=seq.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=hidden,
            **extra,
        )
        seq.length += len(token_ids)
        states = out.hidden_states[-1][0] if hidden else None  # [n, hidden]
        return Scores(logits=out.logits[0], hidden=states)  # logits: [n or 1, vocab]

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[Sequence, Scores]:
        from transformers import DynamicCache

        seq = Sequence(cache=DynamicCache(config=self.model.config), length=0)
        # Only the last position's logits are needed: skips a [prompt, vocab] matmul.
        return seq, self._run(seq, prompt_ids, logits_to_keep=1, hidden=False)

    @torch.inference_mode()
    def forward(self, seq: Sequence, token_ids: list[int], *, hidden: bool = False, tree: TreeLayout | None = None) -> Scores:
        return self._run(seq, token_ids, logits_to_keep=0, hidden=hidden, tree=tree)

    def rollback(self, seq: Sequence, length: int) -> None:
        rollback_cache(seq, length)

    @torch.inference_mode()
    def keep(self, seq: Sequence, start: int, nodes: list[int]) -> None:
        keep_cache_entries(seq, start, nodes)


def rollback_cache(seq: Sequence, length: int) -> None:
    """Cut a `transformers` cache back to `length` tokens; the one place a cache shrinks."""
    if not 0 <= length <= seq.length:
        raise ValueError(f"cannot roll a cache of {seq.length} tokens back to {length}")
    if length < seq.length:
        seq.cache.crop(length - seq.length)  # a negative count: tokens to remove from the end
        seq.length = length


def keep_cache_entries(seq: Sequence, start: int, nodes: list[int]) -> None:
    """Move the entries `start + nodes[j]` to `start + j` in every layer, then cut the rest:
    after a tree pass, only the root and the accepted path stay, in order. A chain's path is
    already in place, so this is then a plain rollback."""
    if any(n < 0 or start + n >= seq.length for n in nodes):
        raise ValueError(f"cannot keep nodes {nodes} after {start} in a cache of {seq.length} tokens")
    if nodes != list(range(len(nodes))):
        source = torch.tensor(nodes, dtype=torch.long, device=seq.cache.layers[0].keys.device) + start  # [len(nodes)]
        for layer in seq.cache.layers:
            for states in (layer.keys, layer.values):  # [batch, heads, length, head_dim]
                states[:, :, start : start + len(nodes)] = states[:, :, source]
    rollback_cache(seq, start + len(nodes))
