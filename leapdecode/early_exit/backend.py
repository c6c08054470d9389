"""Backends that run the target layer by layer: the full model, and drafting with its own layers.

`LayerBackend` is the plain target through `LayerRunner` (equal to the model's own forward).
`SelfDraftBackend` adds `draft`: the same model over a subset of its layers (Draft & Verify's
skipped layers, or LayerSkip's first E layers), writing into the target's own KV cache.

Which draft entries can the verification pass keep? The layers before the first skipped one
(the "exact prefix", all E layers for an early exit) see exactly what the full model would
give them, so their cache entries and their output states are the full model's: the verify
pass reuses them and runs only the remaining layers over the drafted tokens. Every layer
after the first skipped one saw draft-quality inputs, so its draft entries are dropped and
recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from leapdecode.early_exit.runner import LayerRunner
from leapdecode.engine.backend import CacheState, Scores, keep_cache_entries, no_features
from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import MethodError


@dataclass
class LayeredSequence(CacheState):
    """A sequence whose cache layers may run ahead of `length` with drafted tokens."""

    drafted: list[int] = field(default_factory=list)  # tokens the draft layers consumed after `length`
    prefix_states: torch.Tensor | None = None  # [1, len(drafted), hidden]: their states after the exact prefix
    exit_layers: list[int] = field(default_factory=list)  # CALM: layers each generated token used


class LayerBackend:
    """The full model, run through `LayerRunner`; a `Backend` for the decode loop."""

    def __init__(self, model: Any) -> None:
        self.runner = LayerRunner(model)
        self.device: torch.device = self.runner.device
        self.vocab_size: int = int(self.runner.config.vocab_size)
        self.all_layers = tuple(range(self.runner.num_layers))

    @property
    def packer(self) -> None:
        return None  # the layers run one by one, each sequence alone

    @property
    def batchable(self) -> str | None:
        return "a method that runs the target's layers its own way decodes one sequence at a time"

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], *, features: tuple[int, ...] = ()) -> tuple[LayeredSequence, Scores]:
        no_features(features)
        seq = LayeredSequence(cache=self.runner.new_cache(), length=0)
        hidden = self.runner.run(
            seq.cache, self.runner.embed(prompt_ids), self.all_layers, self.runner.positions(0, len(prompt_ids))
        )
        seq.length = len(prompt_ids)
        return seq, Scores(logits=self.runner.head(hidden[:, -1:]))  # [1, vocab]

    @torch.inference_mode()
    def forward(
        self,
        seq: CacheState,
        token_ids: list[int],
        *,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        no_features(features)
        self._drop_draft(seq)
        positions = self.runner.positions(seq.length, len(token_ids))
        if tree is not None and not tree.is_chain:
            positions = seq.length + tree.depth_on(self.device)[None]  # [1, n]
        states = self.runner.run(seq.cache, self.runner.embed(token_ids), self.all_layers, positions, tree)
        seq.length += len(token_ids)
        return self._scores(states)

    def _scores(self, states: torch.Tensor) -> Scores:
        normed = self.runner.norm(states)  # [1, n, hidden]
        return Scores(logits=self.runner.lm_head(normed)[0])

    def _drop_draft(self, seq: CacheState) -> None:
        """Cut every cache layer back to the sequence's length (drop draft-only entries)."""
        self.runner.crop(seq.cache, self.all_layers, seq.length)
        if isinstance(seq, LayeredSequence):
            seq.drafted, seq.prefix_states = [], None

    def rollback(self, seq: CacheState, length: int) -> None:
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll a cache of {seq.length} tokens back to {length}")
        seq.length = length
        self._drop_draft(seq)

    @torch.inference_mode()
    def keep(self, seq: CacheState, start: int, nodes: list[int]) -> None:
        self._drop_draft(seq)
        keep_cache_entries(seq, start, nodes)

    def draft_limit(self, seq: CacheState) -> int | None:
        return None


class SelfDraftBackend(LayerBackend):
    """The full model for verification, and `draft` over a subset of its own layers."""

    def __init__(self, model: Any, draft_layers: tuple[int, ...]) -> None:
        super().__init__(model)
        draft_layers = tuple(sorted(set(draft_layers)))
        num_layers = self.runner.num_layers
        if not draft_layers or any(not 0 <= i < num_layers for i in draft_layers):
            raise MethodError(f"draft layers must be a non-empty subset of 0..{num_layers - 1}, got {draft_layers}")
        if len(draft_layers) == num_layers:
            raise MethodError("drafting with every layer is plain decoding twice: skip at least one layer")
        self.draft_layers = draft_layers
        # The exact prefix: layers 0..P-1 run before the first skipped layer.
        self.prefix = next(i for i in range(num_layers + 1) if i >= len(draft_layers) or draft_layers[i] != i)
        self.prefix_layers = tuple(range(self.prefix))
        self.rest_layers = tuple(range(self.prefix, num_layers))
        self.draft_rest = draft_layers[self.prefix :]

    @torch.inference_mode()
    def draft(self, seq: LayeredSequence, token_ids: list[int]) -> torch.Tensor:
        """Run `token_ids` (continuing the sequence and what was drafted since) through the draft
        layers only; return their draft logits [n, vocab]."""
        positions = self.runner.positions(seq.length + len(seq.drafted), len(token_ids))
        states = self.runner.run(seq.cache, self.runner.embed(token_ids), self.prefix_layers, positions)
        seq.prefix_states = states if seq.prefix_states is None else torch.cat([seq.prefix_states, states], dim=1)
        seq.drafted.extend(token_ids)
        return self.runner.head(self.runner.run(seq.cache, states, self.draft_rest, positions))

    @torch.inference_mode()
    def forward(
        self,
        seq: CacheState,
        token_ids: list[int],
        *,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        """Verification: reuse the exact prefix's work on tokens the draft already ran, run the
        prefix over the rest, then the remaining layers over all of them in one pass."""
        no_features(features)
        if not isinstance(seq, LayeredSequence) or not seq.drafted or (tree is not None and not tree.is_chain):
            return super().forward(seq, token_ids, tree=tree)
        reused = 0
        while reused < min(len(seq.drafted), len(token_ids)) and seq.drafted[reused] == token_ids[reused]:
            reused += 1
        start = seq.length
        assert seq.prefix_states is not None
        states = seq.prefix_states[:, :reused]  # [1, reused, hidden]
        self.runner.crop(seq.cache, self.prefix_layers, start + reused)
        self.runner.crop(seq.cache, self.rest_layers, start)
        seq.drafted, seq.prefix_states = [], None
        if reused < len(token_ids):
            fresh = self.runner.embed(token_ids[reused:])
            fresh = self.runner.run(
                seq.cache, fresh, self.prefix_layers, self.runner.positions(start + reused, len(token_ids) - reused)
            )
            states = torch.cat([states, fresh], dim=1)  # [1, n, hidden]
        states = self.runner.run(seq.cache, states, self.rest_layers, self.runner.positions(start, len(token_ids)))
        seq.length += len(token_ids)
        return self._scores(states)
