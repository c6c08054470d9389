"""What every runner shares, ours and the peers': one timed generation's output, and the device
synchronised at the timer's edges."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.engine import GenerationStats


@dataclass(frozen=True)
class RunOutput:
    """One timed generation: its new tokens and its counters (wall time included)."""

    token_ids: list[int]
    stats: GenerationStats


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer edge is where the work is."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
