"""Parallel decoding without a drafter model: Jacobi decoding and Lookahead decoding.

Greedy output equals plain greedy token for token on tiny random models (several block sizes,
modes, initialisations, and W/N/G), the Jacobi update converges to the greedy tokens, the
combined lookahead/verification tree is checked on a hand-built case (parents, depths = the
position offsets, the attention mask, the cells whose predictions refill the window), and the
n-gram pool is filled from the trajectories and really used. Sampling keeps the distribution.
"""

from __future__ import annotations

import pytest
import torch

from leapdecode.drafters import JacobiDrafter, LookaheadDrafter, NGramModule
from leapdecode.drafters.lookahead import lookahead_paths
from leapdecode.drafters.tree_builder import merge_paths
from leapdecode.engine import StopCriteria, TorchBackend, compile_tree, decode
from leapdecode.engine.reference import greedy_reference
from leapdecode.methods import parse_method
from leapdecode.verifiers import SamplingParams
from tests.helpers import (
    GREEDY,
    assert_follows_exact,
    assert_sampled_like_plain,
    draft_alone,
    exact_joint,
    hear_pass,
    prompts,
    sample_sequences,
    start,
)

DRAFTERS = {
    "jacobi-sliding-repeat": lambda: JacobiDrafter(block=6, mode="sliding", init="repeat"),
    "jacobi-sliding-ngram": lambda: JacobiDrafter(block=4, mode="sliding", init="ngram"),
    "jacobi-block-random": lambda: JacobiDrafter(block=5, mode="block", init="random"),
    "jacobi-1": lambda: JacobiDrafter(block=1),
    "lookahead-5-4-5": lambda: LookaheadDrafter(w=5, n=4, g=5),
    "lookahead-3-2-2": lambda: LookaheadDrafter(w=3, n=2, g=2),
    "lookahead-4-3-0": lambda: LookaheadDrafter(w=4, n=3, g=0),
    "lookahead-anpd": lambda: LookaheadDrafter(w=4, n=3, g=3, anpd=True),
}


def run(model, prompt, drafter, max_new_tokens):
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_parallel_decoding_equals_plain_greedy(tiny_model, name) -> None:
    accepted = passes = 0
    for prompt in prompts(10, seed=3):
        got, steps = run(tiny_model, prompt, DRAFTERS[name](), 40)
        assert got == greedy_reference(tiny_model, prompt, 40), prompt
        accepted += sum(s.num_accepted for s in steps)
        passes += len(steps)
    assert accepted > 0  # guesses really converged and were accepted
    assert passes < 10 * 41


def test_jacobi_fixed_point_from_a_wrong_block() -> None:
    # The Jacobi update on its own: after a pass, the guesses after the first rejected position
    # are the model's predictions there; the prefix that agrees is emitted.
    drafter = JacobiDrafter(block=4, init="repeat")
    start(drafter, [1, 2, 3], first=[9])  # the prefill's token
    assert draft_alone(drafter, 10).tokens == [9, 9, 9, 9]
    # the target's token after the pending 9, then after each guess: first guess right, second
    # wrong, the bonus 5
    hear_pass(drafter, [9, 5], 1, predicted=[9, 5, 6, 7, 8])
    assert draft_alone(drafter, 10).tokens[:3] == [6, 7, 8]  # predictions after the wrong guesses
    block = JacobiDrafter(block=3, mode="block")
    start(block, [1, 2], first=[4])
    assert len(draft_alone(block, 10)) == 3
    hear_pass(
        block, [4, 4, 0], 2, predicted=[4, 4, 0, 0]
    )  # two accepted + bonus: the block of 3 (+ pending) has one left
    assert len(draft_alone(block, 10)) == 0  # ... which the next pass emits without guessing
    hear_pass(block, [0], 0, predicted=[0])
    assert len(draft_alone(block, 10)) == 3  # a new block


def test_lookahead_tree_on_a_hand_built_window() -> None:
    # w=3, n=3: two levels; P is the pending token (level 0, column 0); one pooled tail [x, y].
    P, a, b, c, d, e, x, y = 50, 51, 52, 53, 54, 55, 60, 61
    levels = [[P, a, b], [c, d, e]]
    window = lookahead_paths(levels)
    assert window == [[], [c], [a], [a, d], [a, b], [a, b, e]]
    draft, ends = merge_paths([[x, y]] + window)
    assert draft.tokens == [x, y, c, a, d, b, e]
    assert draft.parents == (-1, 0, -1, -1, 3, 3, 5)
    assert ends == [1, -1, 2, 3, 4, 5, 6]
    tree = compile_tree(draft.parents)
    # positions after the past = depth: level j of column i sits j + i after the pending token
    assert tree.depth.tolist() == [0, 1, 2, 1, 1, 2, 2, 3]
    visible = tree.attention_mask(past=0, dtype=torch.float32, device=torch.device("cpu"))[0, 0] == 0
    # e (level 1, column 2) sees the pending token, level 0 columns 1-2, and itself only
    assert visible[7].tolist() == [True, False, False, False, True, False, True, True]
    # d (level 1, column 1) sees P, a, d; the verification branch sees P and its own path
    assert visible[5].tolist() == [True, False, False, False, True, True, False, False]
    assert visible[2].tolist() == [True, True, True, False, False, False, False, False]


def test_lookahead_fills_levels_then_the_pool_and_drafts_from_it() -> None:
    drafter = LookaheadDrafter(w=3, n=3, g=2)
    start(drafter, [7, 8, 9], first=[10])
    first = draft_alone(drafter, 20)
    assert first.parents is not None and drafter.cells is not None
    hear_pass(drafter, [11], 0, predicted=[11] * (len(first) + 1))
    assert len(drafter.levels) == 2 and drafter.levels[1] == [11, 11, 11]  # warm-up: a level more
    assert drafter.pool == {}
    second = draft_alone(drafter, 20)
    hear_pass(drafter, [11], 0, predicted=[12] * (len(second) + 1))
    assert len(drafter.levels) == 2 and drafter.levels[1] == [12, 12, 12]
    assert list(drafter.pool[11]) == [(11, 12)]  # column 0: [pending 11, 11, prediction 12]
    third = draft_alone(drafter, 20)
    assert third.tokens[:2] == [11, 12]  # the pooled n-gram after the pending 11 is verified first
    assert drafter.propose(1).parents is not None and len(drafter.propose(1)) <= 2  # no window when it cannot fit


def test_ngram_module_counts_added_ngrams() -> None:
    module = NGramModule(3)
    module.initialise([1, 2, 3])
    module.add_ngram([5, 6, 7])
    assert module.query([5, 6]).token == 7 and module.query([6]).token == 7
    assert module.tokens == [1, 2, 3]  # the stream is untouched


def test_method_strings_and_bad_parameters() -> None:
    assert str(parse_method("jacobi")) == "jacobi:block=3,mode=sliding,init=repeat"
    assert str(parse_method("lookahead:w=7,anpd=true")) == "lookahead:w=7,n=3,g=2,anpd=True"
    for bad in (
        "jacobi:mode=wild",
        "jacobi:block=0",
        "jacobi:init=zeros",
        "lookahead:w=1",
        "lookahead:n=9",
        "lookahead:g=-1",
    ):
        with pytest.raises(Exception) as info:
            parse_method(bad)
        assert "MethodError" in type(info.value).__name__


@pytest.mark.slow  # a distribution test: thousands of sampled draws
@pytest.mark.parametrize("name", ["jacobi-sliding-repeat", "lookahead-3-2-2"])
def test_sampling_with_parallel_drafts_keeps_the_distribution(tiny_model, name) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    draws = 600
    counts = sample_sequences(tiny_model, prompt, params, DRAFTERS[name], draws=draws, length=3, seed=11)
    assert_follows_exact(counts, exact, draws)
    # and each seeded run is plain sampling's, token for token
    assert_sampled_like_plain(
        tiny_model, prompt, SamplingParams(0.9, top_p=0.9), DRAFTERS[name], seeds=range(3), length=16
    )
