"""Statistics that say why a method was fast or slow (names as the field uses them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from leapdecode.engine.loop import Step


@dataclass(frozen=True)
class GenerationStats:
    new_tokens: int
    forward_passes: int  # target passes, prefill included
    drafted_tokens: int
    accepted_tokens: int  # drafted tokens the target kept
    wall_time_s: float
    accepted_lengths: tuple[int, ...]  # tokens emitted per decoding pass (after prefill)

    @property
    def tau(self) -> float:
        """Mean accepted tokens per forward pass, bonus token included (1.0 for plain decoding)."""
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def alpha(self) -> float:
        """Draft hit ratio: accepted drafted tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def speedup_bound(self, k: int) -> float:
        """ANPD's bound on the speed-up: alpha * K + 1."""
        return self.alpha * k + 1.0

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["accepted_lengths"] = list(self.accepted_lengths)
        data.update(tau=self.tau, alpha=self.alpha, tokens_per_s=self.tokens_per_s)
        return data

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_time_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.forward_passes} forward passes, tau {self.tau:.2f}, "
            f"alpha {self.alpha:.2f} ({self.accepted_tokens}/{self.drafted_tokens} drafted)"
        )

    @classmethod
    def from_steps(cls, steps: Sequence[Step], wall_time_s: float) -> GenerationStats:
        return cls(
            new_tokens=sum(len(s.tokens) for s in steps),
            forward_passes=len(steps),
            drafted_tokens=sum(len(s.drafted) for s in steps),
            accepted_tokens=sum(s.num_accepted for s in steps),
            wall_time_s=wall_time_s,
            accepted_lengths=tuple(len(s.tokens) for s in steps[1:]),
        )
