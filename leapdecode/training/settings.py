"""What a training run does (`TrainSettings`), where it stands (`Progress`), and its learning rate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from leapdecode.errors import InputError

METHODS = ("eagle3", "medusa")


@dataclass(frozen=True)
class TrainSettings:
    """What a run does; saved with its checkpoint and its model card."""

    method: str = "eagle3"
    data: str = "sharegpt"  # or a .jsonl file of conversations
    steps: int = 2000  # optimizer steps, one sequence each
    lr: float = 3e-4
    warmup: int = 50
    max_tokens: int = 512  # longest training sequence
    ttt_steps: int = 4  # EAGLE-3: steps of the training-time test
    # draft vocabulary size; EAGLE-3: 0 is min(32000, the target's); Medusa: 0 is the whole vocabulary
    # (own LM heads), else the heads share the target's LM head over these tokens
    draft_vocab: int = 0
    intermediate_size: int = 0  # EAGLE-3: the head's MLP width (0: the target's)
    medusa_heads: int = 4
    medusa_layers: int = 1
    limit: int = 0  # conversations read (0: all)
    held_out: int = 8  # held-out conversations for acceptance
    eval_every: int = 250
    eval_tokens: int = 48  # new tokens per held-out prompt when measuring acceptance
    checkpoint_every: int = 100
    cache_gb: float = 4.0  # the target's states kept on disk at most
    mixed_precision: bool = True  # bfloat16 products where the hardware has them natively
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (self.steps >= 1 and self.lr > 0 and self.warmup >= 0, "steps >= 1, lr > 0 and warmup >= 0"),
            (16 <= self.max_tokens <= 8192, f"max_tokens must be between 16 and 8192, got {self.max_tokens}"),
            (1 <= self.ttt_steps <= 16, f"ttt_steps must be between 1 and 16, got {self.ttt_steps}"),
            (1 <= self.medusa_heads <= 16 and 1 <= self.medusa_layers <= 4, "1-16 Medusa heads of 1-4 layers"),
            (self.eval_every >= 1 and self.checkpoint_every >= 1, "eval_every and checkpoint_every >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(f"train-drafter: {message}")


@dataclass
class Progress:
    """The run's state, saved in every checkpoint."""

    step: int = 0
    seconds: float = 0.0  # CPU time spent training (wall clock of this process's steps)
    evals: list[dict[str, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    frac = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
