"""Live pass costs: a measured curve rescaled by what passes take now, and the draft model's
pricing following it (`engine.cost.LiveCost`, `DraftCost.drafted` / `verified`)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.drafters import DraftModelDrafter
from leapdecode.drafters.draft_pricing import DraftCost
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.cost import LIVE_STEP, ForwardCost, LiveCost, scale_of
from leapdecode.engine.reference import greedy_reference
from leapdecode.methods import parse_method
from tests.helpers import GREEDY, prompts, tiny_lm

CURVE = ForwardCost((0.030, 0.031, 0.033, 0.036))


def test_a_live_curve_keeps_its_shape_and_follows_the_passes() -> None:
    live = LiveCost(CURVE, weight=0.5)
    assert [live.of(n) for n in range(1, 7)] == [CURVE.of(n) for n in range(1, 7)]  # nothing seen: as measured
    for _ in range(40):
        live.observe(2, 1.5 * CURVE.of(2))  # every pass takes half as long again as measured
    assert live.scale == pytest.approx(1.5, rel=1e-6)
    assert [live.of(n) / CURVE.of(n) for n in range(1, 7)] == pytest.approx([1.5] * 6)  # the shape kept
    assert live.observed == 40


def test_one_pass_pulls_a_live_curve_at_most_a_clipped_step() -> None:
    live = LiveCost(CURVE, weight=1.0)
    live.observe(1, 100.0)  # a stall: the machine did not get 3,000 times slower
    assert live.scale == pytest.approx(math.exp(LIVE_STEP))
    live.observe(1, 1e-9)
    assert live.scale == pytest.approx(1.0)


def test_a_following_curve_moves_with_its_leader_and_learns_its_own_factor() -> None:
    target = LiveCost(CURVE, weight=1.0)
    draft = LiveCost(ForwardCost((0.010,)), weight=1.0, leader=target)
    target.observe(1, 0.045)  # the machine is half as slow again
    assert draft.scale == pytest.approx(1.5) and draft.of(1) == pytest.approx(0.015) and draft.observed == 0
    draft.observe(1, 0.012)  # the draft model's own passes: cheaper than the machine's slowdown says
    assert draft.scale == pytest.approx(1.2) and target.scale == pytest.approx(1.5)
    target.observe(1, 0.030)  # the machine back as measured: the draft keeps its own factor
    assert draft.scale == pytest.approx(0.8)


def test_passes_outside_the_measured_sizes_leave_a_live_curve_as_it_is() -> None:
    live = LiveCost(CURVE)
    for tokens, seconds in ((0, 0.03), (5, 0.5), (128, 2.0), (2, 0.0), (2, -1.0)):
        live.observe(tokens, seconds)
    assert live.scale == 1.0 and live.observed == 0


def test_a_live_curve_refuses_a_weight_outside_zero_to_one() -> None:
    for weight in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="weight"):
            LiveCost(CURVE, weight=weight)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.floats(1e-4, 10.0)), min_size=1, max_size=30),
    st.floats(0.05, 1.0),
)
def test_a_live_scale_is_the_clipped_recency_weighted_mean_of_log_ratios(passes, weight) -> None:
    """Against a slow reference: the scale stays within what the passes said, and equals the
    clipped update written out."""
    live = LiveCost(CURVE, weight=weight)
    log_scale = 0.0
    for seen, (tokens, seconds) in enumerate(passes):
        live.observe(tokens, seconds)
        error = math.log(seconds / CURVE.of(tokens)) - log_scale
        log_scale += max(weight, 1 / (seen + 2)) * max(-LIVE_STEP, min(LIVE_STEP, error))
    assert math.log(live.scale) == pytest.approx(log_scale, abs=1e-9)
    ratios = [math.log(s / CURVE.of(t)) for t, s in passes]
    assert min(0.0, *ratios) - 1e-9 <= math.log(live.scale) <= max(0.0, *ratios) + 1e-9


def test_the_draft_models_prefill_price_follows_its_live_scale() -> None:
    draft = LiveCost(ForwardCost((0.010,)), weight=1.0)
    cost = DraftCost(draft, LiveCost(CURVE), prefill=0.002)
    assert cost.catch_up == pytest.approx(0.002)
    cost.drafted(1, 0.015)
    assert scale_of(cost.draft) == pytest.approx(1.5) and cost.catch_up == pytest.approx(0.003)
    cost.drafted(5, (0.010 + 4 * 0.002) * 1.5)  # a catch-up feed: a draft pass and four prefill tokens, as priced
    assert scale_of(cost.draft) == pytest.approx(1.5)
    cost.drafted(5, (0.010 + 4 * 0.002) * 2)  # twice what was measured at load
    assert scale_of(cost.draft) == pytest.approx(2.0)
    fixed = DraftCost(ForwardCost((0.010,)), CURVE, prefill=0.002)
    fixed.drafted(1, 0.5)
    fixed.verified(1, 0.5)  # a fixed curve hears nothing
    assert fixed.catch_up == 0.002 and fixed.draft_pass == 0.010 and fixed.target.of(1) == 0.030


class Clock:
    """Virtual seconds: the backends below advance them by what their passes are made to cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedBackend(TorchBackend):
    """A torch backend whose every pass (a prefill too) takes `seconds` of `clock`'s time."""

    def __init__(self, model: torch.nn.Module, clock: Clock, seconds: float) -> None:
        super().__init__(model)
        self.clock, self.seconds = clock, seconds

    def forward(self, *args, **kwargs):  # type: ignore[override]
        self.clock.now += self.seconds
        return super().forward(*args, **kwargs)

    def prefill(self, *args, **kwargs):  # type: ignore[override]
        self.clock.now += self.seconds
        return super().prefill(*args, **kwargs)


def priced(live: bool, prefill: float = 0.0) -> DraftCost:
    """Costs measured at load as 50 ms a draft pass and 30 ms a target pass: too dear to draft."""
    draft_curve, target_curve = ForwardCost((0.050,) * 64), ForwardCost((0.030,) * 8)
    if not live:
        return DraftCost(draft_curve, target_curve, prefill)
    target_now = LiveCost(target_curve, weight=0.5)
    return DraftCost(LiveCost(draft_curve, weight=0.5, leader=target_now), target_now, prefill)


def priced_run(
    model: torch.nn.Module, prompt: list[int], cost: DraftCost, draft_pass: float = 0.003
) -> tuple[list[int], DraftModelDrafter]:
    """The target as its own draft (every draft right), a draft pass (any feed of it) that takes
    `draft_pass` seconds and a target pass 30 ms, priced by `cost`."""
    clock = Clock()
    drafter = DraftModelDrafter(TimedBackend(model, clock, draft_pass), k=4, cost=cost, clock=clock)
    steps = list(decode(TimedBackend(model, clock, 0.030), prompt, drafter, StopCriteria(frozenset(), 64), *GREEDY))
    return [t for s in steps for t in s.tokens], drafter


def test_live_costs_start_drafting_where_the_load_measurement_was_wrong(tiny_model) -> None:
    """Fixed, the wrong measurement keeps the draft model silent but for its probes; live, the
    probes' own passes show the draft is cheap and it drafts; the output never changes."""
    for prompt in prompts(2, seed=31):
        expected = greedy_reference(tiny_model, prompt, 64)
        fixed, silent = priced_run(tiny_model, prompt, priced(live=False))
        moving, drafting = priced_run(tiny_model, prompt, priced(live=True))
        assert fixed == moving == expected
        assert isinstance(drafting.cost, DraftCost) and isinstance(drafting.cost.draft, LiveCost)
        assert drafting.cost.draft.observed > 0 and scale_of(drafting.cost.draft) < 0.6
        assert scale_of(drafting.cost.target) == pytest.approx(1.0)  # its passes take what was measured
        assert drafting.draft_passes > 2 * silent.draft_passes


def test_an_unchecked_price_is_checked_once_by_a_probe_that_pays_the_draft_prefill(tiny_model) -> None:
    """With the draft model's prefill priced (10 ms a token) a request never starts it where its
    first token does not pay: fixed, never; live, its first probe pays the prefill while the
    decoder has never timed the draft model, and then it drafts at its real price. Once timed,
    a draft model that is as dear as measured is never started by a probe."""
    prompt = prompts(1, seed=33)[0]
    expected = greedy_reference(tiny_model, prompt, 64)
    fixed, never = priced_run(tiny_model, prompt, priced(live=False, prefill=0.010))
    assert fixed == expected and never.draft_passes == 0
    cost = priced(live=True, prefill=0.010)
    assert cost.unseen
    moving, started = priced_run(tiny_model, prompt, cost)
    assert moving == expected and not cost.unseen and started.draft_passes > 8
    assert scale_of(cost.draft) < 0.6
    dear = priced(live=True, prefill=0.010)
    dear.drafted(1, 0.050)  # timed once: as dear as measured
    again, quiet = priced_run(tiny_model, prompt, dear, draft_pass=0.050)
    assert again == expected and quiet.draft_passes == 0


def test_the_draft_method_prices_with_live_costs_unless_told_not_to(tiny_model) -> None:
    target = tiny_lm(tiny_model)
    for spec, live in (("draft:k=2", True), ("draft:k=2,live_cost=false", False)):
        method = parse_method(spec)
        factory = method.prepare(target, draft_model=target, backend=TorchBackend(tiny_model), cost=CURVE)
        drafter = factory(*_greedy_request())
        assert isinstance(drafter, DraftModelDrafter) and drafter.cost is not None
        assert isinstance(drafter.cost.draft, LiveCost) is live and isinstance(drafter.cost.target, LiveCost) is live


def _greedy_request():
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.sampling import SamplingParams

    return SamplingParams(), PositionNoise(0)


def test_a_curve_whose_passes_contradict_its_shape_is_forgotten_once_and_a_scaled_one_is_not() -> None:
    """A machine twice as slow as measured is the curve's scale; a curve measured in a busy minute
    (one row 146 ms, four 250 ms) priced passes that now take 24 and 31 ms is the wrong shape:
    once two sizes have 8 passes each, `on_misshapen` is called, once."""
    calls: list[int] = []
    scaled = LiveCost(CURVE, on_misshapen=lambda: calls.append(1))
    for _ in range(30):
        for n in range(1, 5):
            scaled.observe(n, 2.0 * CURVE.of(n))
    assert not scaled.misshapen and calls == []
    busy = ForwardCost((0.146, 0.182, 0.218, 0.250))
    quiet = (0.024, 0.0265, 0.029, 0.031)
    live = LiveCost(busy, on_misshapen=lambda: calls.append(2))
    for _ in range(7):
        for n in (1, 4):
            live.observe(n, quiet[n - 1])
    assert not live.misshapen  # seven passes a size do not judge yet
    for _ in range(20):
        for n in (1, 4):
            live.observe(n, quiet[n - 1])
    assert live.misshapen and calls == [2]
