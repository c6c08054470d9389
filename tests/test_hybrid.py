"""The hybrid drafter (a suffix match grafted onto a recycled tree) and cost-aware cutting of
trees: the grafted tree, the cut tree and what it learns, and greedy decoding equal to plain
decoding (tiny models, the real small model); sampling keeps the target distribution."""

from __future__ import annotations

import functools

import pytest

from leapdecode import wrap
from leapdecode.drafters import Draft, NoDrafter
from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.cost_aware import CostAwareDrafter
from leapdecode.drafters.hybrid import HybridDrafter, graft
from leapdecode.drafters.recycle import RecycleDrafter, RecycleTable
from leapdecode.drafters.suffix import SuffixDrafter, SuffixIndex
from leapdecode.engine import StopCriteria, TorchBackend, compile_tree, decode
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.drafting import Evidence
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

STEEP = ForwardCost((0.047, 0.070, 0.093, 0.115, 0.155, 0.195, 0.236, 0.278))
FLAT = ForwardCost((1.0,) * 8)


def test_graft_merges_a_chain_or_a_tree_into_a_tree_sharing_prefixes() -> None:
    tree = Draft([6, 7, 10], parents=(-1, -1, 0), evidence=(0, 8, 1))
    merged = graft(tree, Draft([6, 11, 12], evidence=(70, 70, 70)))
    assert merged.tokens == [6, 7, 10, 11, 12] and merged.parents == (-1, -1, 0, 0, 3)
    assert merged.evidence == (70, 8, 1, 70, 70)  # the shared node takes the chain's evidence
    compile_tree(merged.parents)
    # a branching suffix draft: 6 -> {10, 13}, 7 -> 14; 6, 7 and 10 are shared
    branched = graft(tree, Draft([6, 7, 10, 13, 14], parents=(-1, -1, 0, 0, 1), evidence=(71, 72, 73, 74, 75)))
    assert branched.tokens == [6, 7, 10, 13, 14] and branched.parents == (-1, -1, 0, 0, 1)
    assert branched.evidence == (71, 72, 73, 74, 75)
    assert graft(Draft(), Draft([4, 5], evidence=(1, 2))).parents == (-1, 0)
    assert len(graft(Draft(), Draft())) == 0


class FixedTree(StreamDrafter):
    """Always the same tree, with evidence per node."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.updates: list[tuple[list[int], int]] = []

    def reset(self, prompt_ids) -> None:
        pass

    def propose(self, max_tokens: int) -> Draft:
        return self.draft

    def update(self, tokens, num_accepted: int) -> None:
        self.updates.append((list(tokens), num_accepted))


def test_cost_aware_cutting_keeps_a_tree_and_learns_which_branches_win() -> None:
    # root children 5 (evidence 1) and 6 (evidence 2); 5 -> 7 (evidence 3)
    inner = FixedTree(
        Draft([5, 6, 7], parents=(-1, -1, 0), evidence=(Evidence("test", 1), Evidence("test", 2), Evidence("test", 3)))
    )
    drafter = CostAwareDrafter(inner, STEEP)
    start(drafter, [1])
    for _ in range(30):  # the target always goes 6 then 9: branch 6 right, branch 5 wrong
        draft = draft_alone(drafter, 8)
        if draft.parents:
            compile_tree(draft.parents)
        accepted = 1 if 6 in draft.tokens else 0
        hear_pass(drafter, [6, 9] if accepted else [6], accepted)
    assert draft.tokens == [6]  # only the winning branch is worth its cost
    assert drafter.estimate.rate(Evidence("test", 2)) > 0.9 > 0.1 > drafter.estimate.rate(Evidence("test", 1))
    flat = CostAwareDrafter(FixedTree(Draft([5, 6, 7], parents=(-1, -1, 0))), FLAT)
    start(flat, [1])
    assert draft_alone(flat, 8).tokens == [5, 6, 7]  # free passes: keep everything
    assert inner.updates[-1] == ([6, 9], 1)  # the inner drafter hears every pass


def test_a_cut_tree_teaches_the_recycling_table_only_its_scored_rows() -> None:
    table = RecycleTable(4)
    table.learn(5, [6, 7])
    drafter = RecycleDrafter(k=4, nodes=4, depth=2, width=2, table=table)
    start(drafter, [5])
    draft_alone(drafter, 4)  # [6, 7], rows 5, 6, 7
    hear_pass(drafter, [8], 0, kept=[1], predicted=[8, 9], candidates=[[8], [9]])  # only 7 was scored
    assert table.next[5] == (8,) and table.next[7] == (9,) and 6 not in table.next


def hybrid(index=None, table=None, factor=1.0):
    return HybridDrafter(SuffixDrafter(16, factor, 0.0, 1, index), RecycleDrafter(8, 8, 4, 4, table))


def test_the_hybrid_tree_holds_the_suffix_chain_and_the_recycled_branches() -> None:
    table = RecycleTable(4)
    table.learn(3, [4, 9])
    drafter = hybrid(table=table, factor=4.0)
    start(drafter, [1, 2, 3, 4, 5, 1, 2, 3])  # "1 2 3" repeats: the suffix drafts 4 5 1 2 3...
    draft = draft_alone(drafter, 16)
    compile_tree(draft.parents)
    assert draft.tokens[:2] == [4, 9]  # the recycled root candidates; 4 shared with the chain
    assert draft.tokens[2:] == ([4, 5, 1, 2, 3] * 3)[1:12]  # factor 4 × a 3-token match, less the shared 4
    assert draft.evidence[0].source == "suffix" and draft.evidence[1].source == "recycle"
    assert drafter.recycle.rows == [3, *draft.tokens]


def run(model, prompt, drafter, n):
    verifiers = (
        functools.partial(verify_greedy, candidates=drafter.needs.candidates),
        functools.partial(verify_tree_greedy, candidates=drafter.needs.candidates),
    )
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), n), *verifiers))
    return [t for s in steps for t in s.tokens], sum(s.num_accepted for s in steps)


@pytest.mark.parametrize("cost", [None, FLAT, STEEP], ids=["uncut", "flat", "steep"])
def test_greedy_hybrid_and_cut_recycling_on_tiny_models_are_plain_decoding(tiny_model, cost) -> None:
    index, table = SuffixIndex(1024), RecycleTable(8)  # fed by the earlier requests
    accepted = 0
    for prompt in prompts(10, seed=7):
        plain, _ = run(tiny_model, prompt, NoDrafter(), 40)
        for drafter in (hybrid(), hybrid(index, table, 3.0), RecycleDrafter(8, 8, 4, 4)):
            if cost is not None:
                drafter = CostAwareDrafter(drafter, cost)
            got, n = run(tiny_model, prompt, drafter, 40)
            assert got == plain
            accepted += n
    assert accepted > 0


@pytest.mark.slow  # a distribution test: thousands of sampled draws
def test_sampling_with_hybrid_drafts_keeps_the_distribution(tiny_model) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    index, table = SuffixIndex(), RecycleTable(4)  # warmed by the draws before
    draws = 600
    counts = sample_sequences(
        tiny_model, prompt, params, lambda: CostAwareDrafter(hybrid(index, table), STEEP), draws=draws, seed=8
    )
    assert_follows_exact(counts, exact, draws)


def test_hybrid_method_on_the_real_model_is_plain_decoding(real_lm) -> None:
    for bad in ("hybrid:suffix_k=0", "hybrid:factor=0", "hybrid:width=9"):
        with pytest.raises(Exception, match="hybrid"):
            parse_method(bad)
    prompts = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "Write a short poem about the sea.",
    ]
    drafted = sum(
        drafted_matching_plain(real_lm, wrap(real_lm, method), prompts, 32)
        for method in ("hybrid:shared=true", "hybrid:cost_aware=false")
    )
    assert drafted > 0
