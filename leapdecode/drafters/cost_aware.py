"""Cost-aware drafting: keep only the part of a draft that is worth its cost on this backend.

Wraps any chain drafter. For each drafted token it estimates the probability of acceptance
(given the tokens before it were accepted) from the recent acceptance of tokens with the same
evidence — the drafter's own confidence when it reports one (`Draft.evidence`: ANPD's n-gram
order and count), else the token's depth — and keeps the prefix that maximises expected tokens
per second under the backend's measured `ForwardCost`. Zero kept tokens is plain decoding.

Dropped tokens still teach: after the pass, the first dropped token would have been accepted
exactly when it equals the target's bonus token, so the estimates keep learning while the
drafter is silenced.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from leapdecode.drafters.base import Draft, Drafter
from leapdecode.engine.backend import Backend
from leapdecode.engine.backend import Sequence as CacheSequence
from leapdecode.engine.cost import ForwardCost


class AcceptanceEstimate:
    """Per evidence bucket, recency-weighted accepted / seen, with a Beta(1, 1) prior."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.counts: dict[Hashable, tuple[float, float]] = {}

    def rate(self, bucket: Hashable) -> float:
        accepted, seen = self.counts.get(bucket, (0.0, 0.0))
        return (accepted + 1.0) / (seen + 2.0)

    def observe(self, bucket: Hashable, accepted: bool) -> None:
        a, s = self.counts.get(bucket, (0.0, 0.0))
        self.counts[bucket] = (a * self.decay + accepted, s * self.decay + 1.0)


class CostAwareDrafter(Drafter):
    """Cuts the inner drafter's chain to the length with the best expected tokens per second."""

    def __init__(self, inner: Drafter, cost: ForwardCost) -> None:
        self.inner = inner
        self.cost = cost
        self.estimate = AcceptanceEstimate()
        self._full: list[int] = []
        self._buckets: list[Hashable] = []
        self._kept = 0
        self.kept_lengths: list[int] = []  # per pass, for statistics and tests

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.inner.reset(prompt_ids)
        self._full, self._buckets, self._kept = [], [], 0
        self.kept_lengths = []

    def attach(self, backend: Backend, seq: CacheSequence) -> None:
        self.inner.attach(backend, seq)

    def buckets(self, draft: Draft) -> list[Hashable]:
        if draft.evidence is not None:
            return [("evidence", e) for e in draft.evidence]
        return [("depth", min(i, 7)) for i in range(len(draft))]

    def propose(self, max_tokens: int) -> Draft:
        draft = self.inner.propose(max_tokens)
        if draft.parents is not None:
            raise ValueError("cost-aware drafting cuts chains; this drafter proposed a tree")
        self._full, self._buckets = list(draft.tokens), self.buckets(draft)
        self._kept = self.cost.best_length([self.estimate.rate(b) for b in self._buckets])
        self.kept_lengths.append(self._kept)
        q = draft.q[: self._kept] if draft.q is not None else None
        return Draft(draft.tokens[: self._kept], q)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        for i in range(num_accepted):
            self.estimate.observe(self._buckets[i], True)
        if num_accepted < self._kept:
            self.estimate.observe(self._buckets[num_accepted], False)
        elif self._kept < len(self._full):
            # The first dropped token, checked for free against the target's own token there.
            self.estimate.observe(self._buckets[self._kept], self._full[self._kept] == tokens[-1])
        self._full, self._buckets = [], []
        self.inner.update(tokens, num_accepted)
