"""What a verifier returns: the verdict on one pass, already on the host (the words p, q,
accepted, rejected and bonus: `verifiers.verdict`). The engine owns the type; the verifiers
(pure functions over tensors) build it."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability, with the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


class Verdict(NamedTuple):
    path: list[int]  # indices of the accepted drafted tokens, root first (a chain: 0..A-1)
    tokens: list[int]  # emitted: the accepted tokens, then the bonus token ([A+1])
    predicted: list[int]  # the target's greedy token after each scored row ([D+1])
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when asked for ([A+1])
    candidates: list[list[int]] | None = (
        None  # the target's top-k token ids at every scored row, when asked for ([D+1][k])
    )

    @property
    def num_accepted(self) -> int:
        return len(self.path)
