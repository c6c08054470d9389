"""Suffix drafting: the automaton against brute force, the shared index's bound and isolation,
and greedy decoding with it equal to plain decoding (tiny models, the real small model);
sampling keeps the target distribution."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode import wrap
from leapdecode.drafters import NoDrafter
from leapdecode.drafters.suffix import SuffixAutomaton, SuffixDrafter, SuffixIndex
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.methods import parse_method
from leapdecode.verifiers import SamplingParams
from tests.conftest import drafted_matching_plain, sample_sequences, GREEDY, assert_follows_exact, exact_joint, prompts, tiny_lm

streams = st.lists(st.integers(0, 3), min_size=1, max_size=60)


def occurs(text: list[int], pattern: list[int]) -> bool:
    return any(text[i : i + len(pattern)] == pattern for i in range(len(text) - len(pattern) + 1))


@settings(max_examples=200, deadline=None)
@given(streams)
def test_the_longest_earlier_match_is_exact_and_its_end_is_real(tokens: list[int]) -> None:
    automaton = SuffixAutomaton()
    for n, token in enumerate(tokens, 1):
        automaton.append(token)
        length, end = automaton.repeat()
        # brute force: the longest suffix of tokens[:n] that also ends before position n-1
        want = max((m for m in range(1, n) if occurs(tokens[: n - 1], tokens[n - m : n])), default=0)
        assert length == want
        if length:
            assert end < n - 1 and tokens[end - length + 1 : end + 1] == tokens[n - length : n]
    # every substring is a path from the root, and nothing else is
    for i in range(len(tokens)):
        state = 0
        for token in tokens[i : i + 6]:
            state = automaton.next[state][token]
    assert len(automaton.length) <= max(2, 2 * len(tokens) - 1) + 1


@settings(max_examples=200, deadline=None)
@given(streams, streams)
def test_matching_another_stream_finds_its_longest_suffix_in_the_index(text: list[int], other: list[int]) -> None:
    automaton = SuffixAutomaton()
    automaton.extend(text)
    state, matched = 0, 0
    for n in range(1, len(other) + 1):
        state, matched = automaton.step(state, matched, other[n - 1])
        want = max((m for m in range(1, n + 1) if occurs(text, other[n - m : n])), default=0)
        assert matched == want
        if matched:
            end = automaton.end[state]
            assert text[end - matched + 1 : end + 1] == other[n - matched : n]


def test_a_draft_copies_after_the_match_and_grows_with_its_length() -> None:
    drafter = SuffixDrafter(k=16, factor=1.0)
    drafter.reset([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])  # "5 6 7" ends the stream and occurred before
    draft = drafter.propose(16)
    assert draft.tokens == [8, 9, 1]  # factor 1 × a 3-token match
    assert len(drafter.propose(2)) == 2  # never past max_tokens
    long = SuffixDrafter(k=5, factor=4.0)
    long.reset([3, 4, 3, 4, 3, 4])  # the match overlaps its own continuation: the copy repeats
    assert long.propose(16).tokens == [3, 4, 3, 4, 3]
    strict = SuffixDrafter(min_match=4)
    strict.reset([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    assert len(strict.propose(16)) == 0
    nothing = SuffixDrafter()
    nothing.reset([1, 2, 3])
    assert len(nothing.propose(8)) == 0
    drafter.update([8, 9], 1)  # the match now runs on: 5 6 7 8 9
    assert drafter.propose(16).tokens[:2] == [1, 2]


def test_the_shared_index_is_bounded_drops_the_oldest_and_never_joins_two_outputs() -> None:
    index = SuffixIndex(max_tokens=100)
    for i in range(30):
        index.add([1000 + i] * 3 + list(range(7)))
        assert index.stored <= 100
        assert len(index.automaton.length) <= 2 * (index.stored + len(index.outputs)) + 1
    assert index.outputs[-1][0] == 1029 and all(out[0] > 1000 for out in index.outputs)  # the oldest went
    joined = SuffixIndex()
    joined.add([1, 2, 3])
    joined.add([4, 5, 6])
    drafter = SuffixDrafter(factor=8.0, index=joined)
    drafter.reset([9, 2, 3])  # "2 3" matches the end of the first output: nothing follows it there
    assert len(drafter.propose(8)) == 0
    drafter.update([4], 0)  # "4" starts the second output: copy it
    assert drafter.propose(8).tokens == [5, 6]  # to the output's end, not into the next one
    drafter.update([5], 1)
    assert drafter.propose(8).tokens == [6]


def test_outputs_reach_later_requests_only_through_a_shared_index(tiny_model) -> None:
    lm = tiny_lm(tiny_model)
    prompt = prompts(3, seed=11)[1]
    for shared in (False, True):
        decoder = wrap(lm, f"suffix:shared={shared},cost_aware=false,factor=8")
        first = decoder.generate(prompt, max_new_tokens=32)
        second = decoder.generate(prompt, max_new_tokens=32)
        assert second.token_ids == first.token_ids
        if shared:  # the second request copies the first's output: nearly every pass accepts drafts
            assert second.stats.forward_passes < first.stats.forward_passes and second.stats.accepted_tokens > first.stats.accepted_tokens
        else:
            assert second.stats.forward_passes == first.stats.forward_passes


@pytest.mark.parametrize("factor,min_match", [(1.0, 1), (4.0, 1), (2.0, 3)], ids=["short", "long", "strict"])
def test_greedy_suffix_drafting_on_tiny_models_is_plain_decoding(tiny_model, factor, min_match) -> None:
    index = SuffixIndex(max_tokens=1024)  # fed by the earlier prompts' requests
    accepted = 0
    for prompt in prompts(12, seed=4):
        plain = run(tiny_model, prompt, NoDrafter(), 40)[0]
        for drafter in (SuffixDrafter(16, factor, 0.0, min_match), SuffixDrafter(16, factor, 0.0, min_match, index)):
            got, n = run(tiny_model, prompt, drafter, 40)
            assert got == plain
            accepted += n
    assert accepted > 0


def run(model, prompt, drafter, n):
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), n), *GREEDY))
    return [t for s in steps for t in s.tokens], sum(s.num_accepted for s in steps)


def test_sampling_with_suffix_drafts_keeps_the_distribution(tiny_model) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    index = SuffixIndex()  # fed by the draws before
    draws = 600
    counts = sample_sequences(tiny_model, prompt, params, lambda: SuffixDrafter(4, 2.0, 0.0, 1, index), draws=draws, seed=6)
    assert_follows_exact(counts, exact, draws)


def test_suffix_method_on_the_real_model_is_plain_decoding(real_lm) -> None:
    assert str(parse_method("suffix")) == "suffix:k=16,factor=1.0,offset=0.0,min_match=1,index_tokens=65536,cost_aware=True"
    for bad in ("suffix:k=0", "suffix:factor=0", "suffix:min_match=0", "suffix:index_tokens=10"):
        with pytest.raises(Exception, match="suffix"):
            parse_method(bad)
    decoder = wrap(real_lm, "suffix:shared=true,cost_aware=false")
    prompts = ["Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", "Write a short poem about the sea."]
    assert drafted_matching_plain(real_lm, decoder, prompts, 40) > 0
