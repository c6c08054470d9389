"""Suffix drafting: the automaton against brute force, the shared index's bound and isolation,
and greedy decoding with it equal to plain decoding (tiny models, the real small model);
sampling keeps the target distribution."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leapdecode import wrap
from leapdecode.drafters import NoDrafter
from leapdecode.drafters.suffix import SuffixAutomaton, SuffixDrafter, SuffixIndex
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.methods import parse_method
from leapdecode.verifiers import SamplingParams
from tests.helpers import (
    GREEDY,
    assert_follows_exact,
    drafted_matching_plain,
    exact_joint,
    prompts,
    sample_sequences,
    tiny_lm,
)

streams = st.lists(st.integers(0, 3), min_size=1, max_size=60)


def occurrences(text: list[int], pattern: list[int]) -> int:
    return sum(text[i : i + len(pattern)] == pattern for i in range(len(text) - len(pattern) + 1))


def occurs(text: list[int], pattern: list[int]) -> bool:
    return occurrences(text, pattern) > 0


@settings(max_examples=200, deadline=None)
@given(streams)
def test_the_longest_earlier_match_is_exact_and_counts_are_occurrences(tokens: list[int]) -> None:
    automaton = SuffixAutomaton()
    for n, token in enumerate(tokens, 1):
        automaton.append(token)
        state, length = automaton.repeat()
        # brute force: the longest suffix of tokens[:n] that also ends before position n-1
        want = max((m for m in range(1, n) if occurs(tokens[: n - 1], tokens[n - m : n])), default=0)
        assert length == want
        if length:
            assert automaton.count[state] == occurrences(tokens[:n], tokens[n - length : n]) >= 2
    # every substring is a path from the root, to a state that counts its occurrences
    for i in range(len(tokens)):
        state = 0
        for j, token in enumerate(tokens[i : i + 6], i + 1):
            state = automaton.next[state][token]
            assert automaton.count[state] == occurrences(tokens, tokens[i:j])
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
            assert automaton.count[state] == occurrences(text, other[n - matched : n])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=60), st.booleans(), st.sampled_from([0.0, 0.05, 0.3]))
def test_a_draft_ranks_what_followed_the_match_by_how_often_it_did(
    tokens: list[int], tree: bool, min_prob: float
) -> None:
    automaton = SuffixAutomaton()
    automaton.extend(tokens)
    state, length = automaton.repeat()
    assume(state > 0)
    draft = automaton.draft_tree(state, True, 12, min_prob, tree)
    match, n = tokens[len(tokens) - length :], len(tokens)
    paths: list[list[int]] = []
    for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        assert parent < i and (tree or parent == i - 1)
        path = [*(paths[parent] if parent >= 0 else []), token]
        paths.append(path)
        before = draft.probs[parent] if parent >= 0 else 1.0
        seen = occurrences(tokens, match + path)
        if seen:  # brute force: how often it followed, of the match's occurrences that go on
            total = occurrences(tokens, match + path[:-1]) - (parent < 0)
            assert abs(draft.ratios[i] - seen / total) < 1e-9
        else:  # past the stream's end: the open occurrence copies its own continuation
            # it reached the string that occurs only at the end after `period` tokens: the copy repeats
            period = next(
                d
                for d in range(1, len(path))
                if (match + path[:d]) == tokens[n - length - d :] and occurrences(tokens, match + path[:d]) == 1
            )
            assert path[-1] == path[-1 - period] and draft.ratios[i] == 1.0
        assert abs(draft.probs[i] - before * draft.ratios[i]) < 1e-9 and draft.probs[i] >= min_prob
        assert i == 0 or draft.probs[i] <= draft.probs[i - 1] + 1e-12  # best first
    assert len({(p, t) for p, t in zip(draft.parents, draft.tokens, strict=True)}) == len(
        draft.tokens
    )  # siblings differ
    if len(draft.tokens) < 12 and tree:  # nothing above min_prob was left out
        for parent, path in [(-1, []), *enumerate(paths)]:
            total = occurrences(tokens, match + path) - (parent < 0)
            before = draft.probs[parent] if parent >= 0 else 1.0
            for token in range(4):
                seen = occurrences(tokens, match + path + [token])
                if seen and total and before * seen / total >= min_prob:
                    assert (parent, token) in set(zip(draft.parents, draft.tokens, strict=True))


def test_the_draft_comes_from_the_match_with_the_most_expected_tokens() -> None:
    drafter = SuffixDrafter(k=8, factor=4.0, min_prob=0.05)
    # "3" was followed by 7 three times and by 9 once; the longer match "2 3" once, by 9
    drafter.reset([3, 7, 1, 3, 7, 1, 3, 7, 1, 2, 3, 9, 5, 2, 3])
    draft = drafter.propose(8)
    # "2 3" (seen once: 9 5 2 3 then repeating) scores 8 > "3"'s 0.75 + ...: the long match wins
    assert draft.tokens == [9, 5, 2, 3, 9, 5, 2, 3] and draft.parents == tuple(range(-1, 7))
    drafter = SuffixDrafter(k=8, factor=1.0, min_prob=0.05)
    drafter.reset([5, 3, 7, 1, 3, 7, 1, 3, 7, 1, 3, 9, 4, 3])
    draft = drafter.propose(8)  # only "3" matches: 7 (3 of 4) and 9 (1 of 4), one token each way
    assert draft.tokens == [7] and draft.evidence is not None
    wide = SuffixDrafter(k=8, factor=8.0, min_prob=0.05)
    wide.reset([5, 3, 7, 1, 3, 7, 1, 3, 7, 1, 3, 9, 4, 3])
    draft = wide.propose(8)  # a tree: 7 1 3 7 ... (p 3/4, then less) and the branch 9 4 3 (p 1/4)
    assert draft.tokens[:2] == [7, 1] and 9 in draft.tokens and draft.parents[draft.tokens.index(9)] == -1
    chain = SuffixDrafter(k=8, factor=8.0, min_prob=0.05, tree=False)
    chain.reset([5, 3, 7, 1, 3, 7, 1, 3, 7, 1, 3, 9, 4, 3])
    draft = chain.propose(8)
    assert draft.tokens == [7, 1, 3, 7, 1, 3, 9, 4] and draft.parents is None  # the most frequent path only


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
            assert (
                second.stats.forward_passes < first.stats.forward_passes
                and second.stats.accepted_tokens > first.stats.accepted_tokens
            )
        else:
            assert second.stats.forward_passes == first.stats.forward_passes


@pytest.mark.parametrize("factor,min_match", [(1.0, 1), (4.0, 1), (2.0, 3)], ids=["short", "long", "strict"])
def test_greedy_suffix_drafting_on_tiny_models_is_plain_decoding(tiny_model, factor, min_match) -> None:
    index = SuffixIndex(max_tokens=1024)  # fed by the earlier prompts' requests
    accepted = 0
    for prompt in prompts(12, seed=4):
        plain = run(tiny_model, prompt, NoDrafter(), 40)[0]
        for drafter in (
            SuffixDrafter(16, factor, 0.0, min_match),
            SuffixDrafter(16, factor, 0.0, min_match, index),
            SuffixDrafter(16, factor, 0.0, min_match, min_prob=0.0),
            SuffixDrafter(16, factor, 0.0, min_match, tree=False),
        ):
            got, n = run(tiny_model, prompt, drafter, 40)
            assert got == plain
            accepted += n
    assert accepted > 0


def run(model, prompt, drafter, n):
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), n), *GREEDY))
    return [t for s in steps for t in s.tokens], sum(s.num_accepted for s in steps)


@pytest.mark.slow  # a distribution test: thousands of sampled draws
def test_sampling_with_suffix_drafts_keeps_the_distribution(tiny_model) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    index = SuffixIndex()  # fed by the draws before
    draws = 600
    counts = sample_sequences(
        tiny_model, prompt, params, lambda: SuffixDrafter(4, 2.0, 0.0, 1, index), draws=draws, seed=6
    )
    assert_follows_exact(counts, exact, draws)


def test_suffix_method_on_the_real_model_is_plain_decoding(real_lm) -> None:
    assert (
        str(parse_method("suffix"))
        == "suffix:k=16,factor=1.0,offset=0.0,min_match=1,min_prob=0.1,tree=True,index_tokens=65536,cost_aware=True"
    )
    chain, tree = parse_method("suffix:tree=false,k=9"), parse_method("suffix:k=9")
    assert (chain.drafts, chain.pass_size, chain.draft_length) == ("chain", 10, 9)
    assert (tree.drafts, tree.pass_size, tree.draft_length) == ("tree", 10, 0)
    for bad in (
        "suffix:k=0",
        "suffix:factor=0",
        "suffix:min_match=0",
        "suffix:index_tokens=10",
        "suffix:min_prob=2",
        "hybrid:min_prob=-1",
    ):
        with pytest.raises(Exception, match="suffix|hybrid"):
            parse_method(bad)
    decoder = wrap(real_lm, "suffix:shared=true,cost_aware=false")
    prompts = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "Write a short poem about the sea.",
    ]
    assert drafted_matching_plain(real_lm, decoder, prompts, 40) > 0
