"""CALM early exit (Schuster et al. 2207.07061): each token leaves the model at the first layer
that is confident enough. Lossy: the output is not the full model's, so its agreement with the
full model is always measured and reported next to its speed.

Confidence after layer i, with h_i the token's hidden state there:
- `softmax`: top-1 minus top-2 probability of the LM head applied to h_i (costs one LM-head
  product per checked layer, so check every few layers on models with a large vocabulary);
- `state`: cosine similarity of h_i and h_{i-1} (saturation: the layer changed little).

A token that exits after layer i still needs keys and values in layers i+1.. for later tokens
to attend to; CALM's state copying fills them from h_i (`LayerRunner.copy_state`).

Agreement is CALM's token-level consistency: the fraction of generated tokens equal to the full
model's greedy token given the same prefix (one teacher-forced pass of the full model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leapdecode.choices import CALM_MEASURES
from leapdecode.early_exit.backend import LayerBackend, LayeredSequence
from leapdecode.engine.backend import CacheState, Scores, no_features
from leapdecode.engine.reference import agreement
from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import MethodError


def confidence(measure: str, logits: torch.Tensor | None, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Per-token confidence [n] from a layer's logits [n, vocab] (softmax) or its state and the
    previous layer's, both [n, hidden] (state)."""
    if measure == "softmax":
        assert logits is not None
        top = logits.float().softmax(-1).topk(2, dim=-1).values  # [n, 2]
        return top[:, 0] - top[:, 1]
    if measure == "state":
        return torch.nn.functional.cosine_similarity(hidden.float(), previous.float(), dim=-1)
    raise MethodError(f"calm: measure must be one of {', '.join(CALM_MEASURES)}, got {measure!r}")


def exit_candidates(num_layers: int, first: int, every: int) -> tuple[int, ...]:
    """Layers after which a token may exit (0-based; the last layer is the full model)."""
    return tuple(range(first, num_layers - 1, every))


class CalmBackend(LayerBackend):
    """The target with per-token early exit on single-token passes (plain decoding's steps)."""

    def __init__(self, model: Any, measure: str, threshold: float, first: int = 0, every: int = 1) -> None:
        super().__init__(model)
        self.measure = measure
        self.threshold = threshold
        self.candidates = frozenset(exit_candidates(self.runner.num_layers, first, every))

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
        if len(token_ids) != 1 or self.threshold >= 1.0 or tree is not None:
            scores = super().forward(seq, token_ids, tree=tree)
            self._record(seq, self.runner.num_layers)
            return scores
        runner = self.runner
        positions = runner.positions(seq.length, 1)
        state = runner.embed(token_ids)  # [1, 1, hidden]
        rope = runner.rotary(state, positions)
        for i in self.all_layers:
            previous, state = state, runner.run(seq.cache, state, (i,), positions, position_embeddings=rope)
            if i not in self.candidates:
                continue
            logits = runner.head(state) if self.measure == "softmax" else None  # [1, vocab]
            if float(confidence(self.measure, logits, state[0], previous[0])[0]) >= self.threshold:
                runner.copy_state(seq.cache, state, self.all_layers[i + 1 :], positions)
                seq.length += 1
                self._record(seq, i + 1)
                return Scores(logits=logits if logits is not None else runner.head(state))
        seq.length += 1
        self._record(seq, runner.num_layers)
        return Scores(logits=runner.head(state))

    @staticmethod
    def _record(seq: CacheState, layers: int) -> None:
        if isinstance(seq, LayeredSequence):
            seq.exit_layers.append(layers)


@dataclass(frozen=True)
class ThresholdPoint:
    threshold: float
    agreement: float  # simulated token-level agreement on the calibration tokens
    mean_layers: float  # layers run per token on average


@torch.inference_mode()
def layer_confidences(
    backend: LayerBackend, token_ids: Sequence[int], measure: str, candidates: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One full pass over `token_ids` layer by layer: for each candidate layer, the confidence
    and greedy token at every position ([C, n] each), and the full model's tokens [n]."""
    runner = backend.runner
    confs, preds = [], []
    for i, previous, state in runner.states_by_layer(token_ids):
        if i in candidates:
            logits = runner.head(state)  # [n, vocab]
            confs.append(confidence(measure, logits, state[0], previous[0]))
            preds.append(logits.argmax(-1))
    final = runner.head(state).argmax(-1)  # [n]: the last layer's state is the full model's
    return torch.stack(confs), torch.stack(preds), final


def simulate_thresholds(
    confs: torch.Tensor,
    preds: torch.Tensor,
    final: torch.Tensor,
    candidates: Sequence[int],
    num_layers: int,
    thresholds: Sequence[float],
) -> list[ThresholdPoint]:
    """Teacher-forced what-if: for each threshold, each token exits at the first candidate layer
    whose confidence passes it; its agreement is that layer's token against the full model's.
    (At run time earlier tokens may have exited too, which this does not model: the benchmark's
    measured agreement is the one to report.)"""
    layers = torch.tensor([c + 1 for c in candidates], dtype=torch.float)  # [C]
    points = []
    for t in thresholds:
        passes = confs >= t if t < 1.0 else torch.zeros_like(confs, dtype=torch.bool)  # [C, n]; 1 never exits
        exited = passes.any(0)  # [n]
        first = passes.float().argmax(0)  # [n]: first passing candidate (0 where none)
        chosen = torch.where(exited, preds.gather(0, first[None])[0], final)
        used = torch.where(exited, layers[first], torch.tensor(float(num_layers)))
        points.append(ThresholdPoint(float(t), agreement(final, chosen), float(used.mean())))
    return points


def pick_threshold(points: Sequence[ThresholdPoint], epsilon: float) -> ThresholdPoint:
    """The lowest threshold (fewest layers) whose agreement stays >= 1 - epsilon; the simple rule
    in place of Learn-then-Test's statistical guarantee."""
    ok = [p for p in points if p.agreement >= 1.0 - epsilon]
    if not ok:
        return max(points, key=lambda p: p.threshold)
    return min(ok, key=lambda p: (p.mean_layers, p.threshold))
