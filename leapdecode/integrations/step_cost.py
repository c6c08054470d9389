"""What a step of a slot-batched engine (vLLM) costs, fitted online from the time between its calls.

Our engine measures its cost curve before decoding (`engine.cost`); inside vLLM we run nothing
ourselves, but the proposer is called once per step, so the time from the end of one call to the
start of the next is one engine step (schedule, forward over every row's pending token and
draft, verify, sample). Fitted as

    seconds = a + b * tokens      (tokens: every row's 1 + drafted tokens in that step)

by recency-weighted least squares, with a prior `b = PRIOR_SLOPE * a` worth `PRIOR_WEIGHT`
observations (it decides while every step scores the same number of tokens and the data cannot).
A row's share of a step drafting n tokens is `a / rows + b * (1 + n)`: the fixed part is paid
once for the batch, each drafted token for itself. With it, cost-aware cutting
(`drafters.cost_aware`) keeps a drafted token only where its chance of acceptance pays for its
row of the pass — on a CPU, where every row costs, a long doubtful chain is cut; on a GPU, where
b is near zero, nothing is.

Only steps where every row decodes (no new request's prefill among them) are fitted: a prefill
scores a whole prompt, which the fit does not model. Nothing here is global: each proposer (one
per engine) owns its fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

PRIOR_SLOPE = 0.1  # a drafted token costs a tenth of a step until the steps say otherwise
PRIOR_WEIGHT = 0.01  # a hundredth of a step: it decides only what the steps cannot
DECAY = 0.98  # ~50 recent steps carry the fit


@dataclass
class _Sums:
    """Recency-weighted sums of (tokens x, seconds y) over fitted steps."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.x = self.x * decay + x
        self.y = self.y * decay + y
        self.xx = self.xx * decay + x * x
        self.xy = self.xy * decay + x * y


class StepCost:
    """The live fit of one engine's step time (module doc); `of(n)` is one row's pass over n tokens.

    Its owner, called once per engine step, calls `elapsed()` first (the step just ended took that
    long), `observe(tokens, seconds)` if that step was a decode step over `tokens` tokens, sets
    `rows` (the rows drafting now), and `call_ended()` last.
    """

    def __init__(
        self, *, prior_slope: float = PRIOR_SLOPE, decay: float = DECAY, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if prior_slope < 0 or not 0 < decay <= 1:
            raise ValueError(f"need prior_slope >= 0 and 0 < decay <= 1, got {prior_slope}, {decay}")
        self.prior_slope = prior_slope
        self.decay = decay
        self.clock = clock
        self.sums = _Sums()
        self.rows = 1
        self.steps = 0  # steps fitted
        self._ended: float | None = None  # when the last call ended
        self.a, self.b = 1.0, prior_slope  # seconds; before any step only their ratio matters

    def elapsed(self) -> float | None:
        """Seconds since the last call ended (the engine's step in between), None on the first call."""
        return None if self._ended is None else self.clock() - self._ended

    def call_ended(self) -> None:
        self._ended = self.clock()

    def observe(self, tokens: int, seconds: float) -> None:
        """One step that scored `tokens` tokens took `seconds`; refit a and b."""
        if seconds <= 0 or tokens < 1:
            return
        s = self.sums
        s.add(float(tokens), seconds, self.decay)
        self.steps += 1
        # least squares of y = a + b x plus PRIOR_WEIGHT * (b - r a)^2, by its normal equations
        r, lam = self.prior_slope, PRIOR_WEIGHT
        m11, m12, m22 = s.w + lam * r * r, s.x - lam * r, s.xx + lam
        det = m11 * m22 - m12 * m12
        if det <= 1e-12 * m11 * m22:
            return
        a = (s.y * m22 - m12 * s.xy) / det
        b = (m11 * s.xy - m12 * s.y) / det
        mean = s.y / s.w
        if a <= 0:  # all of the time in the tokens: keep a little fixed part
            a = 0.05 * mean
        self.a, self.b = a, max(b, 0.0)

    def of(self, tokens: int) -> float:
        """One row's share of a step in which it scores `tokens` (its pending token and its draft)."""
        return self.a / self.rows + self.b * max(tokens, 1)
