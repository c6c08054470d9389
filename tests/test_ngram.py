"""The N-gram module (initialise / update / query, MLN fallback) and the prompt-lookup drafter."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.drafters import AnpdDrafter, NGramModule, PromptLookupDrafter


def brute_force_query(tokens: list[int], context: list[int], n: int) -> int | None:
    """Reference: scan the whole stream; most frequent continuation, ties to the most recent."""
    for order in range(min(n, len(context) + 1), 1, -1):
        key = context[len(context) - order + 1 :]
        seen: dict[int, tuple[int, int]] = {}
        for end in range(order - 1, len(tokens)):
            if tokens[end - order + 1 : end] == key:
                count, _ = seen.get(tokens[end], (0, -1))
                seen[tokens[end]] = (count + 1, end)
        if seen:
            return max(seen, key=lambda t: seen[t])
    return None


def test_initialise_and_query_highest_order_first() -> None:
    module = NGramModule(n=3)
    module.initialise([1, 2, 3, 9, 2, 4])
    # order 3: context (1, 2) -> 3 seen once
    assert module.query([1, 2]).token == 3
    assert module.query([1, 2]).order == 3
    # order 3 has no (7, 2): MLN falls back to order 2, where 2 -> {3, 4}; tie goes to the latest (4)
    prediction = module.query([7, 2])
    assert (prediction.token, prediction.order, prediction.count) == (4, 2, 1)


def test_update_changes_the_prediction_by_count_then_recency() -> None:
    module = NGramModule(n=2)
    module.initialise([5, 6, 5, 7])
    assert module.query([5]).token == 7  # tie 1:1, 7 is more recent
    module.extend([5, 6])
    assert module.query([5]).token == 6  # 6 now seen twice
    assert module.query([5]).count == 2
    module.extend([5, 7])
    assert module.query([5]).token == 7  # tie 2:2 again, 7 most recent


def test_query_misses_return_none() -> None:
    module = NGramModule(n=4)
    module.initialise([1, 2, 3])
    assert module.query([42]) is None
    assert module.query([]) is None


def test_predict_chain_follows_a_repeated_pattern() -> None:
    module = NGramModule(n=3)
    module.initialise([10, 11, 12, 13, 10, 11])
    assert module.predict_chain([10, 11], 5) == [12, 13, 10, 11, 12]


def test_n_below_two_is_rejected() -> None:
    import pytest

    with pytest.raises(ValueError):
        NGramModule(n=1)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    context=st.lists(st.integers(0, 5), min_size=0, max_size=6),
    n=st.integers(2, 6),
)
def test_query_equals_brute_force(tokens: list[int], context: list[int], n: int) -> None:
    module = NGramModule(n=n)
    module.initialise(tokens[: len(tokens) // 2])
    module.extend(tokens[len(tokens) // 2 :])  # init + updates must equal init on everything
    got = module.query(context)
    assert (got.token if got else None) == brute_force_query(tokens, context, n)


def test_anpd_drafter_respects_k_and_budget() -> None:
    drafter = AnpdDrafter(n=3, k=4)
    drafter.reset([1, 2, 3, 1, 2, 3, 1, 2])
    assert drafter.propose(10).tokens == [3, 1, 2, 3]
    assert drafter.propose(2).tokens == [3, 1]
    assert drafter.propose(0).tokens == []
    drafter.update([3, 9], num_accepted=1)  # stream ... 1 2 3 9: nothing ever followed 9
    assert drafter.propose(10).tokens == []
    drafter.update([1], num_accepted=0)  # ... 3 9 1: (9, 1) unseen, order 2 knows 1 -> 2
    assert drafter.propose(3).tokens == [2, 3, 1]  # (2, 3) was followed by 1 twice, by 9 once


def test_anpd_drafter_empty_when_nothing_matches() -> None:
    drafter = AnpdDrafter(n=3, k=4)
    drafter.reset([1, 2, 3])
    assert drafter.propose(4).tokens == []


def test_prompt_lookup_copies_the_latest_earlier_occurrence() -> None:
    drafter = PromptLookupDrafter(k=3, max_ngram=2, min_ngram=1)
    drafter.reset([7, 8, 1, 7, 8, 2, 5, 7, 8])
    # suffix (7, 8) occurred earlier ending at index 4 (latest), followed by 2, 5, 7
    assert drafter.propose(3).tokens == [2, 5, 7]
    drafter.update([4], num_accepted=0)  # ... 7 8 4: suffix (8, 4) unseen, (4) unseen
    assert drafter.propose(3).tokens == []


def test_prompt_lookup_extends_a_period_past_the_end() -> None:
    drafter = PromptLookupDrafter(k=5, max_ngram=1, min_ngram=1)
    drafter.reset([3, 4, 3])
    # 3 occurred at index 0, followed by 4, 3, then the copy repeats with period 2
    assert drafter.propose(5).tokens == [4, 3, 4, 3, 4]
