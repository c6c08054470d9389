"""Calibration for layer skipping: which layers self-speculative drafting should skip.

Draft & Verify searches the skip set with Bayesian optimisation over many generations. This is
a documented cheaper search in two stages:

1. Rank the layers by block influence (ShortGPT, 2403.03853): 1 - cos(input, output) of each
   layer over the calibration prompts' tokens, from one full pass per prompt. Layers that
   barely change the hidden state are the cheapest to skip. The first and last layers are
   never skipped (they change it most, on every model tried).
2. Try skipping the s least influential layers for a few s, generating on the calibration
   prompts with `self-spec`, and keep the s with the least time per token (measured, so that
   it is this machine's trade-off between a cheaper draft and a lower acceptance).

This module holds stage 1; stage 2 decodes through the API, so it lives with the other timed
searches (`leapdecode.bench.calibrate`). The result is saved per model (keyed by its weights)
under the cache folder and reused by `self-spec` with no `skip` (`leapdecode.early_exit.layer_sets`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.early_exit.backend import LayerBackend
from leapdecode.early_exit.layer_sets import format_layer_set, parse_layer_set

__all__ = ["block_influence", "format_layer_set", "parse_layer_set", "skip_order"]


@torch.inference_mode()
def block_influence(backend: LayerBackend, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Per layer [L]: mean over all prompt tokens of 1 - cos(layer input, layer output)."""
    runner = backend.runner
    totals = torch.zeros(runner.num_layers, dtype=torch.float64)
    count = 0
    for ids in prompts:
        for i, previous, state in runner.states_by_layer(ids):
            cos = torch.nn.functional.cosine_similarity(state[0].float(), previous[0].float(), dim=-1)  # [n]
            totals[i] += float((1 - cos).sum())
        count += len(ids)
    return totals / max(count, 1)


def skip_order(influence: torch.Tensor) -> list[int]:
    """Layers from cheapest to dearest to skip, first and last layers excluded."""
    inner = list(range(1, len(influence) - 1))
    return sorted(inner, key=lambda i: float(influence[i]))
