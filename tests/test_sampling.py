"""Speculative sampling keeps the target distribution: synthetic p and q, edge cases, and end to
end on a tiny model against exactly computed probabilities. Seeded runs are reproducible."""

from __future__ import annotations

import pytest
import torch

from leapdecode.drafters import AnpdDrafter, NoDrafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.reference import greedy_reference, sample_reference
from leapdecode.errors import InputError
from leapdecode.verifiers import SamplingParams, logits_to_probs, verify_speculative
from tests.conftest import GREEDY, TINY_VOCAB, ScriptedDrafter, assert_follows_exact, exact_joint, tv, tv_bound

PLAIN = SamplingParams(temperature=1.0)


def first_token_distribution(p: torch.Tensor, q: torch.Tensor | None, draws: int, seed: int, fixed: int = 0) -> torch.Tensor:
    """Draft x ~ q (or the fixed token when q is None: a deterministic drafter), verify, and
    histogram the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    logits = p.log().expand(2, -1)  # [2, vocab]: the drafted position and the bonus position
    counts = torch.zeros_like(p)
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=g)) if q is not None else fixed
        tokens = verify_speculative(torch.tensor([x]), logits, None if q is None else q[None], PLAIN, g).tokens
        counts[int(tokens[0])] += 1
    return counts / draws


def test_rejection_sampler_output_is_p_and_converges() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.distributions.Dirichlet(torch.ones(6)).sample()
    q = torch.distributions.Dirichlet(torch.ones(6)).sample()
    p, q = p / p.sum(), q / q.sum()
    small = first_token_distribution(p, q, 1_000, seed=1)
    large = first_token_distribution(p, q, 16_000, seed=2)
    assert tv(small, p) <= tv_bound(p, 1_000)
    assert tv(large, p) <= tv_bound(p, 16_000)
    assert tv(large, p) < tv(small, p)
    assert tv(large, p) < 0.2 * tv(p, q)
    del g


def test_deterministic_drafter_is_the_one_hot_case() -> None:
    p = torch.tensor([0.1, 0.5, 0.2, 0.2])
    emp = first_token_distribution(p, None, 8_000, seed=3, fixed=1)
    assert tv(emp, p) <= tv_bound(p, 8_000)


def test_p_equal_q_accepts_everything() -> None:
    p = torch.tensor([0.3, 0.3, 0.4])
    g = torch.Generator().manual_seed(4)
    logits = p.log().expand(4, -1)
    for _ in range(200):
        draft = torch.multinomial(p, 3, replacement=True, generator=g)
        verdict = verify_speculative(draft, logits, p.expand(3, -1), PLAIN, g)
        assert verdict.num_accepted == 3 and verdict.tokens[:3] == draft.tolist()


def test_disjoint_supports_always_reject_and_sample_from_p() -> None:
    p = torch.tensor([0.0, 0.0, 0.2, 0.3, 0.5])
    q = torch.tensor([0.6, 0.4, 0.0, 0.0, 0.0])
    emp = first_token_distribution(p, q, 6_000, seed=5)
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


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=0.5, top_k=-2), dict(temperature=0.5, top_p=0.0),
                                    dict(temperature=0.5, top_p=1.5), dict(temperature=0.5, seed="x")])
def test_bad_sampling_parameters(kwargs) -> None:
    with pytest.raises(InputError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("drafter_kind", ["none", "anpd", "scripted-right", "scripted-wrong"])
def test_speculative_sampling_end_to_end_keeps_the_distribution(tiny_model, drafter_kind) -> None:
    # Every token of the vocabulary appears in the prompt with a successor, so the n-gram
    # drafter always has a (bigram) draft to verify.
    prompt = list(range(2, TINY_VOCAB)) + [7, 8, 9]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    greedy = greedy_reference(tiny_model, prompt, 8)
    draws = 600
    g = torch.Generator().manual_seed(7)
    import functools

    verifier = functools.partial(verify_speculative, params=params, generator=g)
    counts: dict[tuple[int, ...], int] = {}
    backend = TorchBackend(tiny_model)
    accepted = drafted = 0
    for i in range(draws):
        drafter = {
            "none": NoDrafter(), "anpd": AnpdDrafter(n=3, k=4),
            "scripted-right": ScriptedDrafter(greedy, k=4, vocab=TINY_VOCAB, seed=i),
            "scripted-wrong": ScriptedDrafter(greedy, k=4, vocab=TINY_VOCAB, wrong_every=1, seed=i),
        }[drafter_kind]
        steps = list(decode(backend, prompt, drafter, StopCriteria(frozenset(), 3), verifier, GREEDY[1]))
        key = tuple(t for s in steps for t in s.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(s.num_accepted for s in steps)
        drafted += sum(len(s.drafted) for s in steps)
    assert_follows_exact(counts, exact, draws)
    if drafter_kind != "none":
        assert drafted > 0  # drafts were really verified
    if drafter_kind == "scripted-right":
        assert accepted > 0  # ... and the acceptance path was exercised


def test_sample_reference_has_the_same_distribution_as_the_engine(tiny_model) -> None:
    prompt = [3, 4, 5]
    params = SamplingParams(temperature=1.2, top_k=2)
    exact = exact_joint(tiny_model, prompt, params, 2)
    g = torch.Generator().manual_seed(8)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(400):
        key = tuple(sample_reference(tiny_model, prompt, 2, params, g))
        counts[key] = counts.get(key, 0) + 1
    assert_follows_exact(counts, exact, 400)


def test_seeded_sampling_is_reproducible(real_lm) -> None:
    from leapdecode import wrap

    decoder = wrap(real_lm, "anpd")
    kwargs = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, chat=True)
    a = decoder.generate("Tell me a short story.", seed=123, **kwargs)
    b = decoder.generate("Tell me a short story.", seed=123, **kwargs)
    c = decoder.generate("Tell me a short story.", seed=321, **kwargs)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert decoder.generate("Hi", generator=g1, **kwargs).token_ids == decoder.generate("Hi", generator=g2, **kwargs).token_ids
