"""What one more token drafted by a draft model costs and earns: the rule `DraftModelDrafter`
drafts by where it has the costs (see its module doc, `cost`).

Pure functions of the measured pass costs and the acceptance rates learnt so far, so the rule
can be read and tested without a model. A drafted token pays when the expected tokens per second
of the step rise with it: its chance of acceptance against one more draft-model pass and one more
verification row (for every sequence of a shared pass, each taken to draft as this one does), and
the first token of a step also carries its share of the draft model's catch-up feed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from leapdecode.drafters.cost_aware import LengthEstimate
from leapdecode.engine.cost import LiveCost, cut_alone, scale_of
from leapdecode.engine.drafting import Draft, Evidence, Offer, PassCost

PROBE_EVERY = 8  # silent steps (no draft: the first token did not pay) before one token is drafted anyway
PROBE_LAG = PROBE_EVERY + 2  # the most tokens a probe feeds: a request alone's since its last probe's verdict
MAX_DEPTH_BUCKET = 8


@dataclass(frozen=True)
class DraftCost:
    """What drafting one more token costs: one draft-model pass (alone, over one token; in a
    shared pass, one packed pass over a row per request), and one more row in the target's
    verification pass."""

    draft: PassCost  # seconds of a draft-model pass by the rows it scores
    target: PassCost  # seconds of a target pass by the rows it scores
    # seconds a draft-model prefill took per prompt token when measured: what each token the
    # draft model's cache lacks beyond a round's one costs to feed (0: not priced)
    prefill: float = 0.0

    @property
    def draft_pass(self) -> float:
        """Seconds of a draft-model pass over one token."""
        return self.draft.of(1)

    @property
    def catch_up(self) -> float:
        """Seconds a draft-model prefill takes per token now: as measured, times the draft
        model's live scale (its passes and its prefills slow down together)."""
        return self.prefill * scale_of(self.draft)

    @property
    def unseen(self) -> bool:
        """Live costs whose draft model has not run yet: its price is still the measurement at
        load, which nothing has checked."""
        return isinstance(self.draft, LiveCost) and self.draft.observed == 0

    def drafted(self, tokens: int, seconds: float) -> None:
        """A draft-model feed of `tokens` tokens, a request alone, took `seconds` (a live curve
        learns from it): one token is a draft pass; more (a catch-up, a window) are priced as the
        pricing charges them, a draft pass and a prefill's rate for the rest."""
        if not isinstance(self.draft, LiveCost):
            return
        if tokens > 1 and self.prefill > 0.0:
            self.draft.pull(seconds, self.draft.base.of(1) + (tokens - 1) * self.prefill)
        else:
            self.draft.observe(tokens, seconds)

    def verified(self, tokens: int, seconds: float) -> None:
        """A target pass over `tokens` tokens, a request alone, took `seconds`."""
        if isinstance(self.target, LiveCost):
            self.target.observe(tokens, seconds)


def depth_bucket(depth: int) -> Hashable:
    """The acceptance-rate bucket of a drafted token at `depth` (1: the first of a step)."""
    return ("depth", min(depth, MAX_DEPTH_BUCKET))


def prob_bucket(depth: int, prob: float) -> Hashable:
    """The bucket of a drafted token by its depth and the draft model's probability decile."""
    return ("prob", min(depth, MAX_DEPTH_BUCKET), min(int(prob * 10), 9))


def catch_up_charge(
    cost: DraftCost,
    lag: int,
    emitted: int,
    max_new_tokens: int | None,
    lengths: LengthEstimate,
    rate: Callable[[Hashable], float],
) -> float:
    """Seconds a step's first drafted token is charged for the `lag` tokens the draft model's
    cache lacks (all but the one every round feeds): fed once, they serve the rest of the
    request, so their cost is spread over the steps it can count on, the tokens the decoder's
    finished requests suggest are still to come (`lengths`) within the budget, at the first
    depth's acceptance `rate` so far. Nothing where the budget is unknown."""
    if lag <= 1 or max_new_tokens is None:
        return 0.0
    ahead = lengths.ahead(emitted, max(1, max_new_tokens - emitted))
    steps = max(1.0, ahead / (1.0 + rate(depth_bucket(1))))
    return (lag - 1) * cost.catch_up / steps


def pays(
    cost: DraftCost, target: PassCost, drafted: int, guess: float, expected: float, batch: int, catch_up: float
) -> bool:
    """Whether one more drafted token, accepted with probability `guess`, raises the step's
    expected tokens per second: `drafted` tokens drafted so far, `expected` tokens expected from
    the step (the bonus token and each drafted one's reach). With `batch` sequences in the
    target's pass (priced by `target`), a drafted token costs `batch` target rows and a round of
    the draft model a packed pass of `batch` rows; a draft-model prefill (`catch_up`, the first
    token's) holds up every request's pass, so it is charged as the batch's."""
    rows, round_ = batch * (drafted + 1), cost.draft.of(batch)
    now = drafted * round_ + target.of(rows)
    more = round_ + batch * catch_up + target.of(rows + batch) - target.of(rows)
    return (expected + guess) / (now + more) > expected / now


def model_rate(cost: DraftCost, rate: Callable[[Hashable], float], budget: int, catch_up: float) -> float:
    """The draft model's best expected tokens per second this step, drafting 0 to `budget`
    tokens at each depth's acceptance `rate` so far: one draft pass per drafted token, one
    verification row each, a request alone."""
    best = 1.0 / cost.target.of(1)
    reach, expected = 1.0, 1.0
    for depth in range(1, budget + 1):
        reach *= rate(depth_bucket(depth))
        expected += reach
        spent = catch_up + depth * cost.draft_pass + cost.target.of(depth + 1)
        best = max(best, expected / spent)
    return best


def match_buckets(match: Draft) -> tuple[tuple[int, ...], list[Hashable]]:
    """A suffix match's parents (a chain's where it has none) and each token's rate bucket: its
    match evidence."""
    evidence = match.evidence or (Evidence("suffix", 0),) * len(match)
    parents = match.parents if match.parents is not None else tuple(range(-1, len(match) - 1))
    return parents, list(evidence)


def match_cut(
    match: Draft, rate: Callable[[Hashable], float], target: PassCost
) -> tuple[list[int], list[float], float]:
    """A suffix match cut to its best part alone (`cut_alone`: the most probable tokens, each
    token's chance its bucket's rate times its parent's): the kept indices, their chances, and
    the expected tokens per second of the step that verifies them."""
    parents, buckets = match_buckets(match)
    reach: list[float] = []
    for bucket, parent in zip(buckets, parents):
        reach.append(rate(bucket) * (reach[parent] if parent >= 0 else 1.0))
    kept = cut_alone(Offer(match, tuple(reach)), target)
    chances = [reach[i] for i in kept]
    return kept, chances, (1.0 + sum(chances)) / target.of(len(kept) + 1)
