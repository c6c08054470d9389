"""Log-probabilities of the emitted tokens: what a full forward pass over the output says, for every
method (chain, tree, draft model, plain), greedy and sampled, without changing a single token."""

from __future__ import annotations

import pytest
import torch

from leapdecode.api import Decoder
from leapdecode.errors import InputError
from tests.helpers import make_tiny_model, prompts, tiny_lm

METHODS = ["ar", "anpd:n=3,k=6,cost_aware=false", "pld", "anpd-tree", "lookahead", "draft:k=3,cost_aware=false"]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(make_tiny_model())


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:  # [len(output), vocab]
    """One uncached pass over prompt + output: the distribution each output token was drawn from."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_reference(model, prompt: list[int], result, top: int) -> None:
    want = reference_logprobs(model, prompt, result.token_ids)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for i, (token, record) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert record.token == token
        assert record.logprob == pytest.approx(want[i, token].item(), abs=1e-4)
        assert len(record.top) == top
        values, ids = want[i].topk(top)
        assert [t for t, _ in record.top] == ids.tolist()
        assert [v for _, v in record.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_logprobs_match_a_full_pass_and_change_no_token(lm, method) -> None:
    draft = tiny_lm(make_tiny_model(seed=1), "tiny-draft") if method.startswith("draft") else None
    decoder = Decoder(lm, method, draft_model=draft)
    drafted = 0
    for prompt in prompts(6, seed=3):
        plain = decoder.generate(prompt, max_new_tokens=24)
        result = decoder.generate(prompt, max_new_tokens=24, logprobs=3)
        assert result.token_ids == plain.token_ids and plain.logprobs is None
        check_against_reference(lm.model, prompt, result, 3)
        # Greedy: each emitted token is its row's most likely one.
        assert all(r.top[0][1] == pytest.approx(r.logprob, abs=1e-6) for r in result.logprobs)
        drafted += sum(s.num_accepted for s in result.steps)
    assert drafted > 0 or method == "ar"


@pytest.mark.parametrize("method", ["ar", "anpd:n=3,k=6,cost_aware=false", "anpd-tree"])
def test_sampled_logprobs_match_a_full_pass_and_take_no_randomness(lm, method) -> None:
    decoder = Decoder(lm, method)
    for seed, prompt in enumerate(prompts(4, seed=4)):
        options = dict(max_new_tokens=20, temperature=0.9, top_k=20, seed=seed)
        plain = decoder.generate(prompt, **options)
        result = decoder.generate(prompt, **options, logprobs=2)
        assert result.token_ids == plain.token_ids
        check_against_reference(lm.model, prompt, result, 2)


def test_logprobs_zero_gives_the_chosen_token_only_and_steps_carry_them(lm) -> None:
    result = Decoder(lm, "anpd").generate([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=12, logprobs=0)
    assert all(r.top == () for r in result.logprobs)
    assert [r for s in result.steps for r in s.logprobs] == list(result.logprobs)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_logprobs_are_refused_before_decoding(lm, bad) -> None:
    with pytest.raises(InputError, match="logprobs"):
        Decoder(lm, "anpd").stream([5, 6, 7], max_new_tokens=4, logprobs=bad)
