"""The randomness of a sampled request, per output position rather than per call.

The token at output position t of a request is chosen from the target's distribution p_t with a
uniform u_t that depends only on (seed, t): a counter-based generator (SplitMix64 of the seed and
the position), never on how many draws came before. Plain sampling picks `choose(p_t, u_t)`; a
verifier picks the same token at every position it decides, and keeps a drafted token only where
it equals that choice. So a sampled run's text is the same whatever was drafted (by any drafter,
cut to any length), and the same as plain sampling with that seed, token for token.

Independent streams at one position (a draft model's own choice when it is not coupled to the
target's, the acceptance test and the residual draw of the min(1, p/q) rule) use other `Stream`
values: each is a separate sequence of uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class Stream(IntEnum):
    """Which of a position's independent uniforms: the target's choice, or the min(1, p/q) rule's."""

    TARGET = 0  # the token the target samples at a position (plain sampling's, and coupled drafts')
    DRAFT = 1  # an uncoupled drafter's own sample
    ACCEPT = 2  # the acceptance test of an uncoupled draft
    RESIDUAL = 3  # the draw from the residual after an uncoupled draft was rejected


def _mix(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words whose outputs pass BigCrush in sequence."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class PositionNoise:
    """A request's uniforms: `uniform(t, stream)` in [0, 1), from (seed, t, stream) alone."""

    seed: int

    def uniform(self, position: int, stream: Stream = Stream.TARGET) -> float:
        key = _mix((self.seed & _MASK) ^ _mix((position * 4 + int(stream) + 1) * _GOLDEN & _MASK))
        return (key >> 11) * (1.0 / (1 << 53))

    def derived(self, stream: Stream) -> PositionNoise:
        """Another request-wide sequence of uniforms, independent of this one: an uncoupled
        drafter's own sampling noise (`Stream.DRAFT`)."""
        return PositionNoise(_mix((self.seed & _MASK) ^ _mix((int(stream) + 1) * _GOLDEN & _MASK)))

    def uniforms(
        self, positions: list[int], stream: Stream = Stream.TARGET, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """[len(positions)] float32 uniforms on `device` (one host-to-device copy)."""
        return torch.tensor([self.uniform(t, stream) for t in positions], dtype=torch.float32, device=device)

    @classmethod
    def for_request(cls, seed: int | None, generator: torch.Generator | None = None) -> PositionNoise:
        """The request's noise: from its seed; else one seed drawn from `generator`, else from torch's
        global generator (so that `torch.manual_seed` makes unseeded runs reproducible, as in HF)."""
        if seed is not None:
            return cls(int(seed))
        drawn = torch.randint(
            0, 2**62, (1,), generator=generator, device=generator.device if generator is not None else "cpu"
        )
        return cls(int(drawn))


def choose(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token each row of `probs` [n, vocab] gives for its uniform `u` [n]: the first token whose
    cumulative probability passes u (the inverse of the distribution function), so a token is
    chosen with exactly its probability and never one of probability 0. Rows are independent: a
    row's choice is the same alone or among others."""
    cumulative = probs.float().cumsum(dim=-1)  # [n, vocab]
    total = cumulative[:, -1:]  # [n, 1]
    # strictly below the total (u rounded to float32 can reach 1), so the first cumulative
    # above it exists and sits where the distribution steps up: a token of positive probability
    target = torch.minimum(
        u.to(cumulative.dtype).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total))
    )  # [n, 1]
    return torch.searchsorted(cumulative, target, right=True).squeeze(-1)  # [n]
