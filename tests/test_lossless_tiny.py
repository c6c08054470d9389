"""Greedy losslessness on tiny random models: every drafter, every acceptance pattern.

Each fast path is compared with `greedy_reference` (no KV cache, recomputed from scratch) and
with Hugging Face `generate(do_sample=False)`.
"""

from __future__ import annotations

import pytest
import torch

from leapdecode.drafters import AnpdDrafter, NoDrafter, PromptLookupDrafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.reference import greedy_reference
from tests.helpers import GREEDY, TINY_VOCAB, ScriptedDrafter, prompts

EOS = 1


def run(model, prompt, drafter, max_new_tokens, eos=frozenset()):
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(eos, max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=max_new_tokens,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "make_drafter",
    [
        lambda: NoDrafter(),
        lambda: AnpdDrafter(n=5, k=7),
        lambda: AnpdDrafter(n=2, k=1),
        lambda: AnpdDrafter(n=3, k=12),
        lambda: PromptLookupDrafter(k=10, max_ngram=3),
    ],
    ids=["ar", "anpd-5-7", "anpd-2-1", "anpd-3-12", "pld"],
)
def test_engine_equals_reference_and_hf(tiny_model, make_drafter) -> None:
    accepted = 0
    for prompt in prompts(12):
        expected = greedy_reference(tiny_model, prompt, 40)
        drafter = make_drafter()
        got, steps = run(tiny_model, prompt, drafter, 40)
        assert got == expected, f"prompt {prompt}"
        assert sum(len(s.tokens) for s in steps) == 40
        accepted += sum(s.num_accepted for s in steps)
    # The drafters must really be exercised: random models fall into loops that n-grams catch.
    assert accepted > 0 or isinstance(drafter, NoDrafter)
    for prompt in prompts(4, seed=1):
        assert run(tiny_model, prompt, make_drafter(), 24)[0] == hf_greedy(tiny_model, prompt, 24)


@pytest.mark.parametrize(
    "wrong_every", [0, 1, 2, 3], ids=["all-right", "all-wrong", "every-2nd-wrong", "every-3rd-wrong"]
)
def test_scripted_drafts_right_wrong_and_partly_right(tiny_model, wrong_every) -> None:
    for seed, prompt in enumerate(prompts(8, seed=2)):
        expected = greedy_reference(tiny_model, prompt, 48)
        drafter = ScriptedDrafter(expected, k=8, vocab=TINY_VOCAB, wrong_every=wrong_every, seed=seed)
        got, steps = run(tiny_model, prompt, drafter, 48)
        assert got == expected
        decode_steps = steps[1:]
        if wrong_every == 1:
            assert all(s.num_accepted == 0 for s in decode_steps)
        if wrong_every == 0:
            assert all(s.num_accepted == len(s.drafted) for s in decode_steps[:-1])
        if wrong_every >= 2:
            assert all(s.num_accepted <= wrong_every - 1 for s in decode_steps)


def test_all_right_drafts_cut_the_number_of_passes(tiny_model) -> None:
    prompt = prompts(1, seed=5)[0]
    expected = greedy_reference(tiny_model, prompt, 60)

    class Always(ScriptedDrafter):
        def propose(self, max_tokens):
            from leapdecode.drafters import Draft

            return Draft([self.reference[self.emitted + i] for i in range(min(self.k, max_tokens))])

    got, steps = run(tiny_model, prompt, Always(expected, k=9, vocab=TINY_VOCAB), 60)
    assert got == expected
    assert len(steps) == 1 + 6  # prefill gives 1 token, then 6 passes of 9 drafts + 1 bonus = 60 tokens
    assert [len(s.tokens) for s in steps[1:]] == [10, 10, 10, 10, 10, 9]


def test_max_new_tokens_never_exceeded_even_when_a_draft_would_overshoot(tiny_model) -> None:
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    expected = greedy_reference(tiny_model, prompt, 50)
    for budget in (1, 2, 3, 7, 11):
        drafter = ScriptedDrafter(expected, k=20, vocab=TINY_VOCAB, seed=budget)
        got, steps = run(tiny_model, prompt, drafter, budget)
        assert got == expected[:budget]
        assert steps[-1].finish_reason == "length"
        assert all(len(s.drafted) <= budget - 1 for s in steps)


def test_eos_inside_an_accepted_draft_stops_exactly_there(tiny_model) -> None:
    prompt = [9, 10, 11, 12]
    reference = greedy_reference(tiny_model, prompt, 30)
    # Declare a token from the middle of the continuation the EOS; drafts that run past it
    # are accepted by the target, yet nothing after it may be emitted.
    eos_pos = 12
    eos = reference[eos_pos]
    first = reference.index(eos)
    drafter = ScriptedDrafter(reference, k=10, vocab=TINY_VOCAB, seed=3)
    got, steps = run(tiny_model, prompt, drafter, 30, eos=frozenset({eos}))
    assert got == reference[: first + 1]
    assert steps[-1].finish_reason == "stop"
    assert greedy_reference(tiny_model, prompt, 30, eos_token_ids=[eos]) == got


def test_empty_drafts_give_plain_decoding_pass_counts(tiny_model) -> None:
    prompt = [3, 4, 5]
    got, steps = run(tiny_model, prompt, NoDrafter(), 16)
    assert len(steps) == 16 and all(len(s.tokens) == 1 for s in steps)
