"""Token Recycling: the adjacency table, the tree it drafts, the verifier's candidates, and greedy
decoding with it equal to plain decoding (tiny models, the real small model); sampling keeps the
target distribution."""

from __future__ import annotations

import functools

import pytest
import torch

from leapdecode import wrap
from leapdecode.drafters import NoDrafter
from leapdecode.drafters.recycle import RecycleDrafter, RecycleTable
from leapdecode.engine import StopCriteria, TorchBackend, compile_tree, decode
from leapdecode.methods import parse_method
from leapdecode.verifiers import SamplingParams, verify_greedy, verify_tree_greedy
from tests.helpers import (
    assert_follows_exact,
    draft_alone,
    drafted_matching_plain,
    exact_joint,
    hear_pass,
    prompts,
    sample_sequences,
    start,
)


def test_the_drafted_tree_follows_the_table_wide_at_the_root() -> None:
    table = RecycleTable(4)
    table.learn(5, [6, 7, 8, 9])
    table.learn(6, [10, 11])
    table.learn(7, [12])
    table.learn(10, [13])
    drafter = RecycleDrafter(k=4, nodes=6, depth=4, width=4, table=table)
    drafter.reset([1, 5])
    draft = drafter.propose(10)
    assert draft.tokens == [6, 7, 8, 9, 10, 11] and draft.parents == (-1, -1, -1, -1, 0, 0)
    compile_tree(draft.parents)  # a valid tree: parents first, siblings distinct
    chain = RecycleDrafter(k=4, nodes=16, depth=4, width=1, table=table)
    chain.reset([5])
    assert chain.propose(10).tokens == [6, 10, 13]  # width 1: the best successor of each
    assert len(chain.propose(2)) == 2  # never past max_tokens levels
    empty = RecycleDrafter(table=RecycleTable(8))
    empty.reset([3])
    assert len(empty.propose(5)) == 0


def test_the_table_learns_every_scored_row_and_top1_under_sampling() -> None:
    drafter = RecycleDrafter(k=3, nodes=4, depth=2, width=2)
    start(drafter, [1, 2])
    draft_alone(drafter, 4)  # nothing known yet: a plain step, one row (the pending token 2)
    hear_pass(drafter, [9], 0, predicted=[9], candidates=[[9, 8, 7]])
    assert drafter.table.next[2] == (9, 8, 7)
    drafter.table.learn(9, [4, 5, 6])
    draft = draft_alone(drafter, 4)  # rows: 9, then the drafted tokens
    hear_pass(drafter, [4], 1, predicted=[4] * (len(draft) + 1))  # sampling: only the greedy token per row
    assert drafter.table.next[9][0] == 4 and drafter.table.next[draft.tokens[0]] == (4,)


def test_verifiers_return_every_rows_top_k() -> None:
    logits = torch.randn(5, 40)
    want = logits.topk(3, dim=-1).indices.tolist()
    assert verify_greedy([1, 2, 3, 4], logits, candidates=3).candidates == want
    assert verify_tree_greedy([1, 2, 3, 4], compile_tree((-1, -1, 0, 1)), logits, candidates=3).candidates == want
    both = verify_greedy([1, 2, 3, 4], logits, logprobs=2, candidates=3)
    assert both.candidates == want and both.logprobs == verify_greedy([1, 2, 3, 4], logits, logprobs=2).logprobs
    assert verify_greedy([1, 2], logits[:3]).candidates is None


def run(model, prompt, drafter, n, candidates=0):
    verifiers = (
        functools.partial(verify_greedy, candidates=candidates),
        functools.partial(verify_tree_greedy, candidates=candidates),
    )
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), n), *verifiers))
    return [t for s in steps for t in s.tokens], sum(s.num_accepted for s in steps)


@pytest.mark.parametrize("width,nodes", [(4, 8), (1, 4), (8, 24)], ids=["tree", "chain", "wide"])
def test_greedy_recycling_on_tiny_models_is_plain_decoding(tiny_model, width, nodes) -> None:
    shared = RecycleTable(8)  # also fed by the earlier requests
    accepted = 0
    for prompt in prompts(10, seed=3):
        plain, _ = run(tiny_model, prompt, NoDrafter(), 40)
        got, n = run(tiny_model, prompt, RecycleDrafter(8, nodes, 4, width), 40, candidates=8)
        assert got == plain
        got, m = run(tiny_model, prompt, RecycleDrafter(8, nodes, 4, width, table=shared), 40, candidates=8)
        assert got == plain
        accepted += n + m
    assert accepted > 0


@pytest.mark.slow  # a distribution test: thousands of sampled draws
def test_sampling_with_recycled_drafts_keeps_the_distribution(tiny_model) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    table = RecycleTable(4)  # warmed by the draws before: drafts get right as it learns
    draws = 600
    counts = sample_sequences(
        tiny_model, prompt, params, lambda: RecycleDrafter(4, 6, 3, 2, table), draws=draws, seed=5
    )
    assert_follows_exact(counts, exact, draws)


def test_recycle_method_on_the_real_model_is_plain_decoding(real_lm) -> None:
    assert str(parse_method("recycle")) == "recycle:k=8,nodes=8,depth=4,width=4,cost_aware=True"
    for bad in ("recycle:width=9", "recycle:k=0", "recycle:nodes=0"):
        with pytest.raises(Exception, match="recycle"):
            parse_method(bad)
    decoder = wrap(real_lm, "recycle:shared=true,cost_aware=false")
    prompts = ["Write a short poem about the sea.", "List three prime numbers and explain why they are prime."]
    assert drafted_matching_plain(real_lm, decoder, prompts, 40) > 0
