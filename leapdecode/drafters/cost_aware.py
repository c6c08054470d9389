"""Cost-aware drafting: keep only the part of a draft that is worth its cost on this backend.

Wraps any drafter, of chains or of trees. For each drafted token it estimates the probability of
acceptance given that its parent was accepted, from the recent acceptance of tokens with the
same evidence — the drafter's own confidence when it reports one (`Draft.evidence`: ANPD's
n-gram order and count, a suffix match's length, a recycled candidate's rank), else the token's
depth. A token is accepted with the product of the estimates along its path (its reach, in the
offer); the pass keeps the most probable tokens (a child is never more probable than its parent,
so it is a tree) in the number that maximises expected tokens per second (`engine.cost.allocate`)
under the backend's measured `ForwardCost` for a pass of the request's own (or, inside vLLM, the
fitted step cost), or the scheduler's curve for a shared pass. Zero kept tokens is plain decoding.

Dropped tokens still teach: after the pass, a dropped token whose parent was accepted would have
been accepted exactly when it equals the target's token there (greedy), so the estimates keep
learning while the drafter is silenced. The estimates belong to the decoder, not to one request
(`cost_aware_factory` shares one among a decoder's greedy requests): how often a kind of evidence
holds is a property of the model and the drafter, and a request that had to learn it afresh
would cut its first passes on the prior's guess. They hold rates per kind of evidence, no text.
But the same evidence holds less often in a chat answer than in code: each request also counts
its own outcomes, and a bucket's rate is the request's with the shared rate as its prior, worth
`PRIOR_WEIGHT` observations (measured on the 1.5B: a conversational answer after code prompts kept
drafting one token a pass at ~7% acceptance, 10-25% slower than plain decoding, until its own
rejections outweighed what code had taught).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

from leapdecode.engine.drafting import (
    Delegating,
    Draft,
    DraftContext,
    Drafter,
    Offer,
    PassCost,
    PassResult,
    Request,
    Rounds,
)


class AcceptanceEstimate:
    """Per evidence bucket, recency-weighted accepted / seen, with a Beta(1, 1) prior."""

    def __init__(self, decay: float = 0.99) -> None:
        self.decay = decay
        self.counts: dict[Hashable, tuple[float, float]] = {}

    def rate(self, bucket: Hashable) -> float:
        accepted, seen = self.counts.get(bucket, (0.0, 0.0))
        return (accepted + 1.0) / (seen + 2.0)

    def observe(self, bucket: Hashable, accepted: bool) -> None:
        a, s = self.counts.get(bucket, (0.0, 0.0))
        self.counts[bucket] = (a * self.decay + accepted, s * self.decay + 1.0)


class LengthEstimate:
    """How many more tokens a request will emit, learnt from the decoder's finished requests: what
    a one-time cost (a draft model's prompt prefill) is repaid over. A budget says how long a
    request may run, not how long it will; served with a large `max_tokens`, most answers stop far
    short of it. The estimate for a request that has emitted t tokens is the mean, over the last
    `keep` finished requests that ran past t, of what they emitted beyond t (capped at the budget
    left). With no history, the whole budget left; a request longer than any before it is counted
    on for as many tokens again as it has emitted (within the budget), as a request of unknown
    length that has lasted t is expected to last about t more. A request stopped by its own budget
    past t counts as one that would have run on; one stopped by its budget before t says nothing."""

    def __init__(self, keep: int = 64) -> None:
        self.finished: deque[tuple[int, bool]] = deque(maxlen=keep)  # (tokens emitted, stopped by its budget)

    def observe(self, emitted: int, budget_reached: bool) -> None:
        self.finished.append((emitted, budget_reached))

    def ahead(self, emitted: int, left: int) -> float:
        """Tokens a request that has emitted `emitted` is expected to emit yet, at most `left`."""
        total, count = 0.0, 0
        for length, capped in tuple(self.finished):
            if length > emitted:  # stopped by its budget: it would have run on, as far as this one may
                total, count = total + (left if capped else min(length - emitted, left)), count + 1
        if count:
            return total / count
        return float(left if not self.finished else min(left, max(emitted, 1)))


def judged(drafted: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[tuple[int, bool]]:
    """Each drafted node (index) whose parent lies on the path the emitted tokens follow down the
    draft, and whether it equals the emitted token at its depth: scored or cut, that is whether it
    would have been accepted, since greedy (or coupled) targets emit the same tokens whatever was
    drafted. Parents come first (-1: the root)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    out: list[tuple[int, bool]] = []
    node = -1
    for token in emitted:
        following = -1
        for child in children.get(node, ()):
            hit = drafted[child] == token
            out.append((child, hit))
            following = child if hit else following
        if following < 0:
            break
        node = following
    return out


PRIOR_WEIGHT = 6.0  # observations the shared rate counts for in a request's own estimate


class RequestEstimate:
    """One request's acceptance rates: its own outcomes, with the decoder's shared rate (which
    it feeds too) as a prior worth `PRIOR_WEIGHT` observations."""

    def __init__(self, shared: AcceptanceEstimate) -> None:
        self.shared = shared
        self.local = AcceptanceEstimate(shared.decay)

    def rate(self, bucket: Hashable) -> float:
        accepted, seen = self.local.counts.get(bucket, (0.0, 0.0))
        return (accepted + PRIOR_WEIGHT * self.shared.rate(bucket)) / (seen + PRIOR_WEIGHT)

    def observe(self, bucket: Hashable, accepted: bool) -> None:
        self.shared.observe(bucket, accepted)
        self.local.observe(bucket, accepted)


class CostAwareDrafter(Delegating):
    """Prices each token of the inner drafter's chain or tree by its reach, so that the pass keeps
    the part with the best expected tokens per second; learns from every drafted token, kept or not."""

    def __init__(self, inner: Drafter, cost: PassCost, estimate: AcceptanceEstimate | None = None) -> None:
        super().__init__(inner)
        self.cost = cost
        self.estimate = estimate if estimate is not None else AcceptanceEstimate()  # shared by a decoder's requests
        self.request = RequestEstimate(self.estimate)  # this request's own outcomes, the shared rate as prior
        self._full = Draft()
        self._parents: tuple[int, ...] = ()  # of the full draft
        self._buckets: list[Hashable] = []
        self.kept_lengths: list[int] = []  # per pass, for statistics and tests

    def start(self, request: Request) -> None:
        self._full, self._parents, self._buckets = Draft(), (), []
        self.kept_lengths = []
        self.request = RequestEstimate(self.estimate)
        self.inner.start(request)

    def buckets(self, draft: Draft, parents: Sequence[int]) -> list[Hashable]:
        if draft.evidence is not None:
            return list(draft.evidence)
        depth: list[int] = []
        for p in parents:
            depth.append(depth[p] + 1 if p >= 0 else 0)
        return [("depth", min(d, 7)) for d in depth]

    def rate(self, bucket: Hashable) -> float:
        """The acceptance rate of `bucket` in this request: its own outcomes, the shared rate as prior."""
        return self.request.rate(bucket)

    def offer(self, context: DraftContext) -> Rounds:
        # the whole draft, each token priced: the scheduler keeps the part that pays (a pass of
        # this request's own by `cost`, a shared pass by its own curve)
        inner = yield from self.inner.offer(context)
        draft = inner.draft
        parents = draft.parents if draft.parents is not None else tuple(range(-1, len(draft) - 1))
        self._full, self._parents, self._buckets = draft, parents, self.buckets(draft, parents)
        reach: list[float] = []  # probability that each token is accepted
        for i, p in enumerate(parents):
            reach.append(self.rate(self._buckets[i]) * (reach[p] if p >= 0 else 1.0))
        return Offer(draft, tuple(reach), self.cost)

    def hear(self, result: PassResult) -> None:
        if result.kept is not None:
            self.kept_lengths.append(len(result.kept))
        # every child of the accepted path's nodes (kept or dropped), judged against the target's token there
        tokens = result.tokens[: result.accepted + 1]
        for child, hit in judged(self._full.tokens, self._parents, tokens):
            self.request.observe(self._buckets[child], hit)
        self._full, self._parents, self._buckets = Draft(), (), []
        self.inner.hear(result)  # the cut indexes the inner drafter's own draft: this one cuts nothing
