"""What a target pass costs, by the number of tokens it scores, and the draft length that pays.

On a GPU one pass over k tokens costs about one token's; on a CPU running quantized llama.cpp
it costs almost k times as much, so a long draft of doubtful tokens loses time. With the cost
curve measured on the backend itself and an acceptance probability per drafted token, the
expected tokens per second of keeping L drafted tokens is

    (1 + sum_{i<=L} prod_{j<=i} a_j) / cost(L + 1)

(the bonus token always comes), and `best_length` picks the L that maximises it; L = 0 means
decode one plain token. Pure arithmetic over curves: measuring one is `engine.cost_measure`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from leapdecode.engine.drafting import Offer, PassCost


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one target pass over n tokens, for n = 1..len(seconds). `spread`: how quiet the
    machine was while they were measured (`engine.cost_measure`): how much slower a size's
    second-fastest repeat ran than its fastest, the median over sizes (0: not measured so)."""

    seconds: tuple[float, ...]
    spread: float = 0.0

    def __post_init__(self) -> None:
        if not self.seconds or any(s <= 0 for s in self.seconds):
            raise ValueError(f"a cost curve needs positive seconds for 1..n tokens, got {self.seconds}")

    def of(self, tokens: int) -> float:
        """Cost of a pass over `tokens` tokens; past the measured range, the last slope goes on."""
        n = len(self.seconds)
        if tokens <= n:
            return self.seconds[max(tokens, 1) - 1]
        slope = self.seconds[-1] - self.seconds[-2] if n > 1 else self.seconds[-1]
        return self.seconds[-1] + slope * (tokens - n)

    def expected_rate(self, accept: Sequence[float], length: int) -> float:
        """Expected emitted tokens per second when the first `length` drafted tokens are kept."""
        survive, expected = 1.0, 1.0
        for a in accept[:length]:
            survive *= a
            expected += survive
        return expected / self.of(length + 1)

    def best_length(self, accept: Sequence[float]) -> int:
        """The draft length in 0..len(accept) with the most expected tokens per second."""
        return max(range(len(accept) + 1), key=lambda length: (self.expected_rate(accept, length), -length))


LIVE_WEIGHT = 0.1  # each observed pass moves a live curve's scale a tenth of the way: ~10 recent passes carry it
LIVE_STEP = math.log(2.0)  # one pass moves it by at most this log-factor: a stall is not the machine's speed
SHAPE_PASSES = 8  # passes of one size before what they take judges the curve's shape
SHAPE_TOLERANCE = math.log(1.15)  # sizes whose live factors differ by more: the measured shape is wrong


class LiveCost:
    """A measured cost curve rescaled online by what passes take now. The measurement at load
    takes a few seconds of a machine whose speed drifts (other load, its clock, the context
    growing), and whether a draft model pays can hinge on the ratio of two such measurements
    taken seconds apart; the passes a decoder runs anyway measure both again, every step. The
    curve keeps its measured shape (how a pass grows with its rows) and one factor follows the
    machine: a recency-weighted mean of log(observed / measured), each pass's pull clipped.

    With a `leader` (the target's curve, timed every step), this curve's factor is the leader's
    times its own, and its own passes learn only the latter: a draft model that has not run for
    a while is taken to have slowed down or sped up with the machine, not to cost what it did.

    One factor cannot mend a wrong shape (a curve measured while other work ran: one row three
    times too dear, four rows not): each size's passes keep a factor of their own too, and once two
    sizes' factors, each over `SHAPE_PASSES` passes, differ by more than `SHAPE_TOLERANCE`, the
    curve is `misshapen` and `on_misshapen` is called once (the store forgets the curve, so that
    the next start measures it again)."""

    def __init__(
        self,
        base: ForwardCost,
        weight: float = LIVE_WEIGHT,
        leader: LiveCost | None = None,
        on_misshapen: Callable[[], None] | None = None,
    ) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"a live curve's weight must be in (0, 1], got {weight}")
        self.base = base
        self.weight = weight
        self.leader = leader
        self.offset = 0.0  # the log of this curve's own factor (over its leader's)
        self.observed = 0  # passes that moved it
        self.sizes: dict[int, tuple[float, int]] = {}  # tokens -> (its passes' mean log(observed / measured), passes)
        self.on_misshapen = on_misshapen
        self.misshapen = False

    @property
    def log_scale(self) -> float:
        return self.offset + (self.leader.log_scale if self.leader is not None else 0.0)

    @property
    def scale(self) -> float:
        """What passes take now over what was measured."""
        return math.exp(self.log_scale)

    def of(self, tokens: int) -> float:
        return self.base.of(tokens) * self.scale

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass over `tokens` tokens took `seconds`. Passes past the measured sizes (a prefill,
        a long catch-up feed) are not the curve's to judge, and leave it as it is."""
        if 1 <= tokens <= len(self.base.seconds):
            self.pull(seconds, self.base.of(tokens))
            if seconds > 0.0:
                self._judge_shape(tokens, math.log(seconds / self.base.of(tokens)))

    def _judge_shape(self, tokens: int, ratio: float) -> None:
        mean, passes = self.sizes.get(tokens, (0.0, 0))
        weight = max(self.weight, 1.0 / (passes + 1))
        self.sizes[tokens] = (mean + weight * (ratio - mean), passes + 1)
        settled = [m for m, n in self.sizes.values() if n >= SHAPE_PASSES]
        if not self.misshapen and len(settled) > 1 and max(settled) - min(settled) > SHAPE_TOLERANCE:
            self.misshapen = True
            if self.on_misshapen is not None:
                self.on_misshapen()

    def pull(self, seconds: float, measured: float) -> None:
        """Some work the measurement at load priced at `measured` seconds took `seconds` now."""
        if seconds <= 0.0 or measured <= 0.0:
            return
        error = math.log(seconds / measured) - self.log_scale
        # the first passes weigh as a mean of all so far (the measurement at load counting as
        # one), then each `weight`: a few passes correct a wrong measurement, later ones follow
        weight = max(self.weight, 1.0 / (self.observed + 2))
        self.offset += weight * max(-LIVE_STEP, min(LIVE_STEP, error))
        self.observed += 1


def scale_of(cost: PassCost) -> float:
    """A curve's live scale (1 for a fixed one)."""
    return cost.scale if isinstance(cost, LiveCost) else 1.0


def allocate(
    offers: Sequence[Offer | None], caps: Sequence[int], base_rows: int, decoding: int, cost: PassCost, budget: int
) -> list[list[int]]:
    """Which drafted tokens each request keeps in a pass: the most probable tokens across all
    offers (parents before children, at most `caps[i]` of request i, within `budget` rows in all)
    in the number with the most expected tokens per second, `decoding + sum(reach) / cost(rows)`,
    where `base_rows` rows (pending tokens, prompts) are there anyway and are worth `decoding`
    tokens (a pending token one, and a prompt row one to the scheduler: work needed either way). An
    offer without reach is kept whole up to its cap and the budget, before any other (None: no draft). One offer with
    one pending row is the cut of a pass of one request's own (`engine.pass_plan.cut_offers`)."""
    kept: list[list[int]] = [[] for _ in offers]
    rows = base_rows
    candidates: list[tuple[float, int, int]] = []
    for i, offer in enumerate(offers):
        if offer is None:
            continue
        if offer.reach is None:
            kept[i] = list(range(max(0, min(len(offer.draft), caps[i], budget - rows))))
            rows += len(kept[i])
        else:
            candidates.extend((-r, i, t) for t, r in enumerate(offer.reach))
    # most probable first; a child never precedes its parent (lower reach, or a tie and a later index)
    candidates.sort()
    chosen: list[tuple[int, int]] = []
    best, best_rate, expected = 0, decoding / cost.of(max(rows, 1)), float(decoding)
    taken: list[set[int]] = [set() for _ in offers]
    for negative_reach, i, t in candidates:
        offer = offers[i]
        assert offer is not None
        parent = offer.draft.parents[t] if offer.draft.parents is not None else t - 1
        if len(taken[i]) >= caps[i] or (parent >= 0 and parent not in taken[i]) or rows + len(chosen) >= budget:
            continue
        taken[i].add(t)
        chosen.append((i, t))
        expected -= negative_reach
        rate = expected / cost.of(rows + len(chosen))
        if rate > best_rate:
            best, best_rate = len(chosen), rate
    for i, t in chosen[:best]:
        kept[i].append(t)
    return [sorted(k) for k in kept]


def cut_alone(offer: Offer, cost: PassCost) -> list[int]:
    """`allocate` for one offer alone in a pass, the pending row there anyway (a draft model's
    suffix match priced against its own draft, `drafters.draft_pricing.match_cut`)."""
    size = len(offer.draft)
    return allocate([offer], [size], 1, 1, cost, 1 + size)[0]


KNEE = 1.1  # a pass of `efficient_rows` costs at most this much per row over the best pass's


def efficient_rows(cost: PassCost, max_rows: int) -> int:
    """The fewest rows at which a pass costs at most `KNEE` x the lowest cost per row of any pass
    up to `max_rows` rows: a bigger pass saves (almost) nothing per row, and only makes the
    requests decoding in it wait longer for their next token."""
    per_row = [cost.of(n) / n for n in range(1, max_rows + 1)]
    best = min(per_row)
    return next(n for n, c in enumerate(per_row, 1) if c <= KNEE * best)


def share_rows(needs: list[int], rows: int) -> list[int]:
    """`rows` shared among prompts that still need `needs` rows (oldest first): an equal share
    each, what a prompt needs less than its share going to the others, the remainder to the
    oldest (max-min fairness)."""
    given = [0] * len(needs)
    open_ = [i for i, need in enumerate(needs) if need > 0]
    while rows > 0 and open_:
        each = max(1, rows // len(open_))
        for i in list(open_):
            take = min(each, needs[i] - given[i], rows)
            given[i] += take
            rows -= take
            if given[i] == needs[i]:
                open_.remove(i)
            if rows == 0:
                break
    return given


def nondecreasing_fit(values: Sequence[float]) -> tuple[float, ...]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a longer
    pass never really costs less, and one slow measurement is averaged with its neighbours
    instead of raising every longer size to it (what a running maximum would do)."""
    blocks: list[tuple[float, int]] = []  # (mean, how many values it pools)
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            before, pooled = blocks.pop()
            mean, count = (before * pooled + mean * count) / (pooled + count), pooled + count
        blocks.append((mean, count))
    return tuple(mean for mean, count in blocks for _ in range(count))
