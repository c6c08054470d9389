"""Sampling: per-position noise, the verifiers' rules on synthetic p and q, and end to end on tiny
models — the distribution kept (against exactly computed probabilities) and, for every drafter
that does not sample its own drafts, sampled text equal to plain sampling's with the same seed,
token for token, whatever was drafted. Seeded runs are reproducible through the API."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.drafters import AnpdDrafter, AnpdTreeDrafter, NoDrafter, PromptLookupDrafter
from leapdecode.drafters.cost_aware import AcceptanceEstimate, CostAwareDrafter
from leapdecode.engine.noise import PositionNoise, Stream, choose
from leapdecode.engine.reference import greedy_reference, sample_reference
from leapdecode.errors import InputError
from leapdecode.verifiers import SamplingParams, logits_to_probs, verify_speculative
from tests.helpers import (
    TINY_VOCAB,
    ScriptedDrafter,
    assert_follows_exact,
    assert_sampled_like_plain,
    exact_joint,
    prompts,
    sample_sequences,
    tv,
    tv_bound,
)

PLAIN = SamplingParams(temperature=1.0)
SETTINGS = [
    SamplingParams(1.0),
    SamplingParams(0.7, top_k=5),
    SamplingParams(1.3, top_p=0.9),
    SamplingParams(0.9, 8, 0.8),
]


# --- per-position noise ---------------------------------------------------------------------


def test_noise_depends_on_seed_position_and_stream_only() -> None:
    a, b = PositionNoise(11), PositionNoise(11)
    assert [a.uniform(t) for t in range(50)] == [b.uniform(t) for t in reversed(range(50))][
        ::-1
    ]  # order of calls is irrelevant
    assert a.uniform(3) != PositionNoise(12).uniform(3)
    assert a.uniform(3) != a.uniform(3, Stream.ACCEPT) != a.uniform(3, Stream.RESIDUAL)
    assert a.derived(Stream.DRAFT).uniform(3) not in (a.uniform(3), a.uniform(3, Stream.DRAFT))
    values = torch.tensor([a.uniform(t, s) for t in range(4000) for s in Stream])
    assert 0.0 <= float(values.min()) and float(values.max()) < 1.0
    # uniform on [0, 1): each tenth holds about a tenth (4 standard deviations)
    hist = torch.histc(values, bins=10, min=0.0, max=1.0) / len(values)
    assert float((hist - 0.1).abs().max()) < 4 * (0.1 * 0.9 / len(values)) ** 0.5


def test_noise_for_a_request_follows_its_seed_or_generator() -> None:
    assert PositionNoise.for_request(5) == PositionNoise(5)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert PositionNoise.for_request(None, g1) == PositionNoise.for_request(None, g2)
    torch.manual_seed(9)
    first = PositionNoise.for_request(None)
    torch.manual_seed(9)
    assert PositionNoise.for_request(None) == first


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_choose_is_row_independent_and_never_picks_an_impossible_token(rows: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=g) ** 3
    probs[torch.rand(rows, vocab, generator=g) < 0.4] = 0.0
    probs[:, int(torch.randint(vocab, (1,), generator=g))] += 0.1  # every row has a token
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(rows, generator=g)
    u[0] = 0.0
    together = choose(probs, u)
    for r in range(rows):
        alone = choose(probs[r : r + 1].clone(), u[r : r + 1])
        assert int(alone) == int(together[r]) and float(probs[r, together[r]]) > 0
    assert float(probs[0, choose(probs[:1], torch.tensor([1.0]))]) > 0  # u rounded up to 1


def test_choose_gives_each_token_its_probability() -> None:
    p = torch.tensor([[0.1, 0.0, 0.25, 0.65]])
    grid = (torch.arange(10_000) + 0.5) / 10_000  # evenly spread uniforms
    picks = choose(p.expand(len(grid), -1), grid)
    freq = torch.bincount(picks, minlength=4).float() / len(grid)
    torch.testing.assert_close(freq, p[0], atol=1e-3, rtol=0)


# --- the verifiers' rules on synthetic p and q ----------------------------------------------


def first_token_distribution(
    p: torch.Tensor, q: torch.Tensor | None, draws: int, seed: int, *, coupled: bool = False, fixed: int = 0
) -> torch.Tensor:
    """Draft x from q (the min(1, p/q) rule: the draft's own stream; coupled: the target's
    uniform), or the fixed token when q is None; verify; histogram the first emitted token."""
    logits = p.log().expand(2, -1)  # [2, vocab]: the drafted position and the bonus position
    counts = torch.zeros_like(p)
    for i in range(draws):
        noise = PositionNoise(seed * 1_000_003 + i)
        if q is None:
            x, q_rows = fixed, None
        elif coupled:
            x, q_rows = int(choose(q[None], noise.uniforms([0]))[0]), None
        else:
            x, q_rows = int(choose(q[None], noise.derived(Stream.DRAFT).uniforms([0]))[0]), q[None]
        tokens = verify_speculative([x], logits, q_rows, PLAIN, noise, position=0).tokens
        counts[int(tokens[0])] += 1
        if q_rows is None:  # coupled: the emitted token is plain sampling's, whatever was drafted
            assert tokens[0] == int(choose(p[None], noise.uniforms([0]))[0])
    return counts / draws


@pytest.mark.slow  # a distribution test: thousands of sampled draws
@pytest.mark.parametrize("coupled", [False, True])
def test_rejection_sampler_output_is_p_and_converges(coupled: bool) -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(6, generator=g), -1)
    q = torch.softmax(2 * torch.randn(6, generator=g), -1)
    small = first_token_distribution(p, q, 1_000, seed=1, coupled=coupled)
    large = first_token_distribution(p, q, 16_000, seed=2, coupled=coupled)
    assert tv(small, p) <= tv_bound(p, 1_000)
    assert tv(large, p) <= tv_bound(p, 16_000)


def test_deterministic_drafter_is_the_one_hot_case() -> None:
    p = torch.tensor([0.1, 0.5, 0.2, 0.2])
    emp = first_token_distribution(p, None, 8_000, seed=3, fixed=1)
    assert tv(emp, p) <= tv_bound(p, 8_000)


def test_p_equal_q_accepts_everything() -> None:
    p = torch.tensor([0.3, 0.3, 0.4])
    logits = p.log().expand(4, -1)
    for i in range(200):
        noise = PositionNoise(i)
        draft = choose(p.expand(3, -1), noise.derived(Stream.DRAFT).uniforms([0, 1, 2])).tolist()
        verdict = verify_speculative(draft, logits, p.expand(3, -1), PLAIN, noise, position=0)
        assert verdict.num_accepted == 3 and verdict.tokens[:3] == draft


def test_disjoint_supports_always_reject_and_sample_from_p() -> None:
    p = torch.tensor([0.0, 0.0, 0.2, 0.3, 0.5])
    q = torch.tensor([0.6, 0.4, 0.0, 0.0, 0.0])
    for coupled in (False, True):
        emp = first_token_distribution(p, q, 6_000, seed=5, coupled=coupled)
        assert emp[:2].sum() == 0
        assert tv(emp, p) <= tv_bound(p, 6_000)


def test_logits_to_probs_matches_hugging_face_warpers() -> None:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(6)
    logits = torch.randn(3, 50) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9), (2.0, 1, 0.5)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        expected = scores.softmax(-1)
        got = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p))
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-9])
def test_a_top_p_too_small_for_float32_keeps_the_most_probable_token(top_p) -> None:
    """A valid top_p that rounds to 0 in float32 (a fuzzed request sent 5e-324) keeps one token,
    not none (all -inf, NaN probabilities, a sampled id past the vocabulary)."""
    logits = torch.randn(3, 50) * 3
    probs = logits_to_probs(logits, SamplingParams(1.0, 0, top_p))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0),
        dict(temperature=0.5, top_k=-2),
        dict(temperature=0.5, top_p=0.0),
        dict(temperature=0.5, top_p=1.5),
        dict(temperature=0.5, seed="x"),
    ],
)
def test_bad_sampling_parameters(kwargs) -> None:
    with pytest.raises(InputError):
        SamplingParams(**kwargs)


# --- end to end on tiny models ---------------------------------------------------------------


def _drafters(greedy: list[int]) -> dict[str, object]:
    """Every kind of draft: none, n-gram chains and trees, and scripted ones that are all right,
    all wrong and partly right (random lengths)."""
    counter = iter(range(10**6))
    return {
        "none": NoDrafter,
        "anpd": lambda: AnpdDrafter(n=3, k=4),
        "pld": lambda: PromptLookupDrafter(k=5),
        "anpd-tree": lambda: AnpdTreeDrafter(n=3, nodes=8, depth=4, width=3),
        "right": lambda: ScriptedDrafter(greedy, k=5, vocab=TINY_VOCAB, seed=next(counter)),
        "wrong": lambda: ScriptedDrafter(greedy, k=5, vocab=TINY_VOCAB, wrong_every=1, seed=next(counter)),
        "partly": lambda: ScriptedDrafter(greedy, k=5, vocab=TINY_VOCAB, wrong_every=3, seed=next(counter)),
    }


@pytest.mark.parametrize("kind", ["none", "anpd", "pld", "anpd-tree", "right", "wrong", "partly"])
def test_sampled_text_equals_plain_sampling_token_for_token(tiny_model, kind: str) -> None:
    drafted = 0
    for i, prompt in enumerate(prompts(4, seed=21)):
        greedy = greedy_reference(tiny_model, prompt, 24)
        params = SETTINGS[i % len(SETTINGS)]
        drafted += assert_sampled_like_plain(
            tiny_model, prompt, params, _drafters(greedy)[kind], seeds=range(i * 10, i * 10 + 3), length=24
        )
    if kind != "none":
        assert drafted > 0


class _JitteryCost:
    """A pass cost that changes every time it is read, from nearly flat to steep: cost-aware
    cutting keeps a different part of each draft on every step, as noisy timings make it do."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def of(self, tokens: int) -> float:
        return 0.01 * (1 + self.rng.random() * 2 * (tokens - 1))


def test_sampled_text_does_not_depend_on_how_drafts_are_cut(tiny_model) -> None:
    """Cost-aware cutting decided from timings must not change a seeded run's text."""
    prompt = prompts(3, seed=5)[0]
    greedy = greedy_reference(tiny_model, prompt, 32)
    params = SamplingParams(0.8, top_p=0.95)
    drafted = set()
    for run in range(4):

        def make(run: int = run) -> CostAwareDrafter:
            inner = ScriptedDrafter(greedy, k=8, vocab=TINY_VOCAB, wrong_every=4, seed=run)
            return CostAwareDrafter(inner, _JitteryCost(run), AcceptanceEstimate())

        drafted.add(assert_sampled_like_plain(tiny_model, prompt, params, make, seeds=[7, 8], length=32))
    assert len(drafted) > 1  # the runs really drafted differently


@pytest.mark.slow  # a distribution test: thousands of sampled draws
@pytest.mark.parametrize("drafter_kind", ["none", "anpd", "right", "wrong"])
def test_speculative_sampling_end_to_end_keeps_the_distribution(tiny_model, drafter_kind) -> None:
    # Every token of the vocabulary appears in the prompt with a successor, so the n-gram
    # drafter always has a (bigram) draft to verify.
    prompt = list(range(2, TINY_VOCAB)) + [7, 8, 9]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    greedy = greedy_reference(tiny_model, prompt, 8)
    make = _drafters(greedy)[drafter_kind]
    counts = sample_sequences(tiny_model, prompt, params, make, draws=600, length=3, seed=7)
    assert_follows_exact(counts, exact, 600)


def test_sample_reference_has_the_same_distribution_as_the_engine(tiny_model) -> None:
    prompt = [3, 4, 5]
    params = SamplingParams(temperature=1.2, top_k=2)
    exact = exact_joint(tiny_model, prompt, params, 2)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(400):
        key = tuple(sample_reference(tiny_model, prompt, 2, params, PositionNoise(1000 + i)))
        counts[key] = counts.get(key, 0) + 1
    assert_follows_exact(counts, exact, 400)


# --- the API and the real model --------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_method_independent(real_lm) -> None:
    from leapdecode import wrap

    kwargs = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, chat=True)
    prompt = "Write a Python function that reverses a list, then explain it."
    plain = wrap(real_lm, "ar").generate(prompt, seed=123, **kwargs)
    for method in ("anpd", "anpd:cost_aware=false", "pld", "suffix", "hybrid", "anpd-tree", "lookahead"):
        decoder = wrap(real_lm, method)
        a = decoder.generate(prompt, seed=123, **kwargs)
        assert a.token_ids == plain.token_ids, method
        assert decoder.generate(prompt, seed=123, **kwargs).token_ids == a.token_ids
    assert wrap(real_lm, "anpd").generate(prompt, seed=321, **kwargs).token_ids != plain.token_ids
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    decoder = wrap(real_lm, "anpd")
    assert (
        decoder.generate("Hi", generator=g1, **kwargs).token_ids
        == decoder.generate("Hi", generator=g2, **kwargs).token_ids
    )


def test_greedy_requests_leave_the_global_generator_alone(tiny_model) -> None:
    from leapdecode import wrap
    from tests.helpers import tiny_lm

    decoder = wrap(tiny_lm(tiny_model), "anpd:cost_aware=false")
    torch.manual_seed(4)
    before = torch.get_rng_state()
    decoder.generate([5, 6, 7, 5, 6], max_new_tokens=8)
    assert torch.equal(before, torch.get_rng_state())
