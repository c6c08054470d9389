"""The cost model and cost-aware drafting: the draft length that pays, on hand-made curves."""

from __future__ import annotations

import itertools

import pytest

from leapdecode.drafters import Draft
from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.cost_aware import AcceptanceEstimate, CostAwareDrafter
from leapdecode.engine.backend import CacheState
from leapdecode.engine.cost import ForwardCost, nondecreasing_fit
from leapdecode.engine.cost_measure import measure_forward_cost
from leapdecode.engine.drafting import Evidence
from tests.helpers import GREEDY, draft_alone, hear_pass, start


def test_flat_cost_keeps_every_token_a_linear_cost_keeps_only_sure_ones() -> None:
    flat = ForwardCost((1.0,) * 8)  # a GPU: k tokens cost one
    linear = ForwardCost(tuple(float(n) for n in range(1, 9)))  # llama.cpp on two cores: k tokens cost k
    assert flat.best_length([0.3] * 7) == 7  # any chance is free
    assert linear.best_length([0.3] * 7) == 0  # every token costs a full pass: only certainty pays
    assert linear.best_length([0.99] * 7) == 0  # still a loss: 1 + 0.99 tokens for the cost of 2
    # llama.cpp measured on the 1.5B model: 1 token 47 ms, 4 tokens 115 ms, 8 tokens 278 ms
    measured = ForwardCost((0.047, 0.070, 0.093, 0.115, 0.155, 0.195, 0.236, 0.278))
    assert measured.best_length([0.9] * 7) >= 3  # a confident draft pays for a few tokens
    assert measured.best_length([0.2] * 7) == 0  # a doubtful one does not
    assert measured.best_length([0.95, 0.95, 0.1, 0.9]) == 2  # cut before the doubtful token


def test_expected_rate_by_hand() -> None:
    cost = ForwardCost((1.0, 2.0, 3.0))
    # keep 2 tokens accepted with 0.5 then 0.5: 1 + 0.5 + 0.25 tokens in 3 s
    assert cost.expected_rate([0.5, 0.5], 2) == pytest.approx(1.75 / 3.0)
    assert cost.of(5) == pytest.approx(5.0)  # the last slope goes on past the measured range
    with pytest.raises(ValueError):
        ForwardCost(())


def test_acceptance_estimate_learns_and_forgets() -> None:
    est = AcceptanceEstimate(decay=0.9)
    assert est.rate("a") == 0.5  # the prior
    for _ in range(30):
        est.observe("a", True)
    assert est.rate("a") > 0.85
    for _ in range(30):
        est.observe("a", False)
    assert est.rate("a") < 0.15  # recent rejections outweigh old acceptances


NINE = Evidence("test", 9)  # one kind of evidence


class FixedDrafter(StreamDrafter):
    def __init__(self, tokens: list[int], evidence: tuple[int, ...] | None = None) -> None:
        self.tokens, self.evidence_ = tokens, evidence
        self.updates: list[tuple[list[int], int]] = []

    def reset(self, prompt_ids) -> None:
        pass

    def propose(self, max_tokens: int) -> Draft:
        return Draft(self.tokens[:max_tokens], evidence=self.evidence_)

    def update(self, tokens, num_accepted: int) -> None:
        self.updates.append((list(tokens), num_accepted))


def test_cost_aware_drafter_stops_drafting_when_drafts_fail_and_learns_from_dropped_tokens() -> None:
    cost = ForwardCost((0.047, 0.070, 0.093, 0.115, 0.155))
    inner = FixedDrafter([5, 6, 7, 8], evidence=(NINE,) * 4)
    drafter = CostAwareDrafter(inner, cost)
    start(drafter, [1, 2])
    first = draft_alone(drafter, 10)
    assert 0 < len(first) <= 4  # the prior (0.5) is worth a token or two on this curve
    for _ in range(20):  # the target never agrees
        hear_pass(drafter, [99], 0)
        draft = draft_alone(drafter, 10)
    assert len(draft) == 0  # not worth it any more: plain decoding
    for _ in range(40):  # the dropped first token now always matches the target's token
        hear_pass(drafter, [5], 0)
        draft = draft_alone(drafter, 10)
    assert len(draft) > 0  # learned from dropped tokens alone
    assert inner.updates[-1] == ([5], 0)  # the inner drafter hears every pass
    hear_pass(drafter, [5], 0)
    assert drafter.kept_lengths[-1] == len(draft)  # what each pass kept, for statistics


def test_a_decoders_greedy_requests_share_what_cutting_learned() -> None:
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.methods.base import cost_aware_factory

    cost = ForwardCost((0.047, 0.070, 0.093, 0.115, 0.155))
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8)
    factory = cost_aware_factory(lambda sampling, noise: FixedDrafter([5, 6, 7, 8], evidence=(NINE,) * 4), cost)
    first = factory(greedy, None)
    start(first, [1, 2])
    assert len(draft_alone(first, 10)) > 0  # the prior is worth a token or two
    for _ in range(20):  # the target never agrees
        hear_pass(first, [99], 0)
        draft_alone(first, 10)
    second = factory(greedy, None)  # the next request of the same decoder
    start(second, [3, 4])
    assert second.estimate is first.estimate and len(draft_alone(second, 10)) == 0
    # a sampled request starts afresh: its drafts, so its draws, depend on its prompt and seed only
    for fresh in (
        factory(sampled, None),
        cost_aware_factory(lambda sampling, noise: FixedDrafter([5, 6]), cost)(greedy, None),
    ):
        start(fresh, [3, 4])
        assert fresh.estimate is not first.estimate and len(draft_alone(fresh, 10)) > 0


@pytest.mark.parametrize(
    "curve", [(1.0,) * 8, (0.047, 0.070, 0.093, 0.115, 0.155, 0.195, 0.236, 0.278)], ids=["flat", "steep"]
)
def test_cost_aware_anpd_equals_plain_greedy_on_tiny_models(tiny_model, curve) -> None:
    from leapdecode.drafters import AnpdDrafter
    from leapdecode.engine import StopCriteria, TorchBackend, decode
    from leapdecode.engine.reference import greedy_reference
    from tests.helpers import prompts

    drafted = 0
    for prompt in prompts(8):
        drafter = CostAwareDrafter(AnpdDrafter(n=3, k=7), ForwardCost(curve))
        steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 30), *GREEDY))
        assert [t for s in steps for t in s.tokens] == greedy_reference(tiny_model, prompt, 30)
        drafted += sum(len(s.drafted) for s in steps)
    assert drafted > 0


def test_cost_aware_methods_equal_plain_greedy_on_the_real_model(real_lm) -> None:
    from leapdecode.api import wrap

    prompt = "for i in range(10):\n    print(i)\nfor j in range(10):\n   "
    expected = wrap(real_lm, "ar").generate(prompt, max_new_tokens=24).token_ids
    for method in ("anpd:cost_aware=true", "pld:cost_aware=true"):
        assert wrap(real_lm, method).generate(prompt, max_new_tokens=24).token_ids == expected, method


def test_tree_methods_cut_by_a_curve_of_tree_passes_cached_apart_from_chains(tiny_model) -> None:
    import torch

    from leapdecode.engine import TorchBackend
    from leapdecode.methods import parse_method
    from leapdecode.methods.base import cached_cost
    from tests.helpers import tiny_lm

    lm, backend, quiet = tiny_lm(tiny_model), TorchBackend(tiny_model), (lambda m: None)
    chain = cached_cost(lm, backend, 5, quiet)
    tree = cached_cost(lm, backend, 5, quiet, tree=True)
    assert tree is not chain and len(tree.seconds) == 5
    assert all(b >= a for a, b in zip(tree.seconds, tree.seconds[1:], strict=False))
    assert cached_cost(lm, backend, 3, quiet) is chain and cached_cost(lm, backend, 4, quiet, tree=True) is tree
    parse_method("hybrid").prepare(lm, backend=backend, log=quiet)  # 8 nodes + 16 chained + the root
    assert len(lm.costs[(type(backend).__name__, torch.get_num_threads(), True)].seconds) == 25


def test_nondecreasing_fit_pools_an_outlier_instead_of_raising_every_longer_size() -> None:
    assert nondecreasing_fit([1.0, 2.0, 2.0, 5.0]) == (1.0, 2.0, 2.0, 5.0)  # already monotone: unchanged
    fitted = nondecreasing_fit([99.0, 107.0, 225.0, 120.0, 125.0, 130.0, 140.0, 150.0])
    assert all(b >= a for a, b in itertools.pairwise(fitted))
    assert fitted[-1] == 150.0 and fitted[2] < 225.0  # a running maximum would give 225 from size 3 on
    assert fitted[2:7] == pytest.approx([(225.0 + 120.0 + 125.0 + 130.0 + 140.0) / 5] * 5)  # pooled until monotone
    assert nondecreasing_fit([3.0, 2.0, 1.0]) == pytest.approx((2.0, 2.0, 2.0))


class ClockedBackend:
    """A backend whose passes take scripted time on a fake clock: n tokens cost n, and three
    passes in a row (from the `slow`-th) are delayed by a burst of other load."""

    vocab_size = 100

    def __init__(self, clock: list[float], slow: int) -> None:
        self.clock, self.slow, self.passes = clock, slow, 0

    def prefill(self, prompt_ids: list[int]) -> tuple[CacheState, None]:
        return CacheState(cache=None, length=len(prompt_ids)), None

    def forward(self, seq: CacheState, token_ids: list[int], **kwargs: object) -> None:
        self.passes += 1
        self.clock[0] += len(token_ids) + (50.0 if self.slow <= self.passes < self.slow + 3 else 0.0)
        seq.length += len(token_ids)

    def rollback(self, seq: CacheState, length: int) -> None:
        seq.length = length


def test_a_burst_of_load_during_measurement_does_not_bend_the_curve() -> None:
    clock = [0.0]
    # the burst from any timed pass on (pass 1 is the warm-up); measuring one size at a time, it
    # would cover all three repeats of one size and, through a running maximum, every longer size
    for slow in range(2, 2 + 3 * 6):
        measured = measure_forward_cost(
            ClockedBackend(clock, slow),  # type: ignore[arg-type]
            6,
            context=4,
            repeats=3,
            timer=lambda: clock[0],
        )
        assert measured.seconds == tuple(float(n) for n in range(1, 7))


def test_a_request_whose_drafts_fail_stops_drafting_though_earlier_requests_did_well() -> None:
    """The shared rates are only a prior: a request's own rejections cut its drafts even when
    earlier requests (code, say) taught the decoder that the same evidence usually holds."""
    cost = ForwardCost((0.047, 0.070, 0.093, 0.115, 0.155))
    shared = AcceptanceEstimate()
    for _ in range(200):
        shared.observe(NINE, True)
    drafter = CostAwareDrafter(FixedDrafter([5, 6, 7, 8], evidence=(NINE,) * 4), cost, shared)
    start(drafter, [1, 2])
    assert len(draft_alone(drafter, 10)) >= 3  # the decoder's experience: draft most of it
    for _ in range(12):  # this request's target never agrees
        hear_pass(drafter, [99], 0)
        draft = draft_alone(drafter, 10)
    assert len(draft) == 0 and shared.rate(NINE) > 0.8  # cut here, the shared rate still high
    fresh = CostAwareDrafter(FixedDrafter([5, 6, 7, 8], evidence=(NINE,) * 4), cost, shared)
    start(fresh, [3, 4])
    assert len(draft_alone(fresh, 10)) > 0  # the next request starts from the shared rate again


def test_the_cost_cut_drafts_nothing_when_every_price_says_no(tiny_model) -> None:
    """A kept curve where a pass costs in proportion to its tokens (llama.cpp's shape on two
    cores): no drafted token can pay, so a cost-aware method drafts nothing, on text that repeats
    and invites drafts, and is plain decoding pass for pass."""
    from leapdecode import wrap
    from leapdecode.engine.backend import TorchBackend
    from leapdecode.engine.cost_store import default_store
    from leapdecode.methods.base import curve_key
    from tests.helpers import tiny_lm

    lm = tiny_lm(tiny_model)
    linear = ForwardCost(tuple(0.01 * n for n in range(1, 65)))
    backend = TorchBackend(lm.model, exact_tokens=lm.exact_tokens)
    for tree in (False, True):  # chains and trees (`suffix`, `hybrid`)
        default_store().put(curve_key(lm, backend, tree=tree), linear)
    prompt = [5, 6, 7, 8, 9] * 8
    for method in ("anpd", "suffix", "hybrid"):
        out = wrap(lm, method).generate(prompt, max_new_tokens=24)
        plain = wrap(lm, "ar").generate(prompt, max_new_tokens=24)
        assert out.token_ids == plain.token_ids
        assert out.stats.drafted_tokens == 0 and out.stats.forward_passes == plain.stats.forward_passes, method
