"""Token trees: layouts from parent lists, the tree attention mask and positions (against
hand-built cases and against scoring every root-to-node sequence from scratch), KV-cache
compaction after accepting a non-first branch, and the tree verifiers (greedy and sampling)."""

from __future__ import annotations

import functools

import pytest
import torch

from leapdecode.drafters import Draft
from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine import StopCriteria, TorchBackend, chain_parents, compile_tree, decode, keep_cache_entries
from leapdecode.engine.noise import PositionNoise
from leapdecode.engine.reference import greedy_reference
from leapdecode.verifiers import SamplingParams, verify_speculative, verify_tree_greedy, verify_tree_speculative
from tests.helpers import GREEDY, TINY_VOCAB
from tests.test_sampling import assert_follows_exact, exact_joint, tv, tv_bound

#        root
#       /    \
#     d0      d1
#    /  \       \
#  d2    d3      d4
#   |
#  d5
PARENTS = (-1, -1, 0, 0, 1, 2)


def test_layout_of_a_hand_built_tree() -> None:
    tree = compile_tree(PARENTS)
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert tree.path_to(6) == [1, 3, 6] and tree.path_to(0) == []
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestors, expected)
    mask = tree.attention_mask(past=3, dtype=torch.float32, device=torch.device("cpu"))
    assert mask.shape == (1, 1, 7, 10)
    assert (mask[0, 0, :, :3] == 0).all()  # the prefix is visible to every node
    assert torch.equal(mask[0, 0, :, 3:] == 0, expected)
    assert not tree.is_chain and compile_tree(chain_parents(4)).is_chain


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-2,), (-1, 0, 5)])
def test_bad_parent_lists_are_refused(parents) -> None:
    with pytest.raises(ValueError):
        compile_tree(parents)


def test_tree_pass_scores_each_node_as_its_own_sequence(tiny_model) -> None:
    backend = TorchBackend(tiny_model)
    prompt = [5, 9, 14, 3, 22]
    tokens = [40, 41, 42, 43, 44, 45]
    tree = compile_tree(PARENTS)
    with torch.inference_mode():
        seq, _ = backend.prefill(prompt[:-1])
        logits = backend.forward(seq, [prompt[-1], *tokens], tree=tree).logits  # [7, vocab]
        for node in range(tree.num_nodes):
            sequence = prompt + [tokens[i - 1] for i in tree.path_to(node)]
            expected = tiny_model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, rtol=1e-4, atol=1e-4)


def test_cache_keeps_only_a_non_first_branch_in_place(tiny_model) -> None:
    backend = TorchBackend(tiny_model)
    prompt = [5, 9, 14, 3, 22]
    tokens = [40, 41, 42, 43, 44, 45]
    with torch.inference_mode():
        seq, _ = backend.prefill(prompt[:-1])
        start = seq.length
        backend.forward(seq, [prompt[-1], *tokens], tree=compile_tree(PARENTS))
        keep_cache_entries(seq, start, [0, 2, 5])  # root, d1, d4: the second branch
        assert seq.length == start + 3
        # the compacted cache must continue exactly like the plain sequence prompt + d1 + d4
        after = backend.forward(seq, [7]).logits[-1]
        expected = tiny_model(input_ids=torch.tensor([prompt + [41, 44, 7]]), use_cache=False).logits[0, -1]
        torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError):
            keep_cache_entries(seq, start, [0, 9])


def test_greedy_tree_verifier_walks_the_matching_branch() -> None:
    tree = compile_tree(PARENTS)
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    logits = torch.full((7, 20), -5.0)
    for node, best in enumerate([11, 3, 14, 0, 0, 0, 0]):  # root->d1 (11), d1->d4 (14), d4->bonus 0
        logits[node, best] = 5.0
    path, kept, *_ = verify_tree_greedy(tokens, tree, logits)
    assert path == [1, 4] and kept == [11, 14, 0]
    logits[0] = -5.0
    logits[0, 7] = 5.0  # no child of the root matches
    path, kept, *_ = verify_tree_greedy(tokens, tree, logits)
    assert path == [] and kept == [7]


def test_tree_speculative_sampling_keeps_p_over_siblings() -> None:
    # Three siblings of the root drafted deterministically; the first emitted token must follow p.
    p = torch.tensor([0.05, 0.3, 0.25, 0.1, 0.3])
    tree = compile_tree((-1, -1, -1))
    tokens = torch.tensor([1, 4, 0])
    logits = p.log().expand(4, -1)
    params = SamplingParams(temperature=1.0)
    draws = 8000
    counts = torch.zeros(5)
    for i in range(draws):
        kept = verify_tree_speculative(tokens, tree, logits, params, PositionNoise(i), position=0).tokens
        counts[int(kept[0])] += 1
    assert tv(counts / draws, p) <= tv_bound(p, draws)


class ModelTree(StreamDrafter):
    """A tree of likely tokens, from the model itself: its top two tokens after the stream,
    and (room permitting) the top token after the first of them. Deterministic, so q is one-hot."""

    def __init__(self, model) -> None:
        self.model = model

    def reset(self, prompt_ids):
        self.stream = list(prompt_ids)

    def update(self, tokens, num_accepted):
        self.stream.extend(tokens)

    def propose(self, max_tokens):
        if max_tokens < 1:
            return Draft()
        with torch.inference_mode():
            a, b = self.model(input_ids=torch.tensor([self.stream])).logits[0, -1].topk(2).indices.tolist()
            if max_tokens < 2:
                return Draft([a, b], parents=(-1, -1))
            c = int(self.model(input_ids=torch.tensor([self.stream + [a]])).logits[0, -1].argmax())
        return Draft([a, b, c], parents=(-1, -1, 0))


@pytest.mark.slow  # a distribution test: thousands of sampled draws
def test_tree_sampling_end_to_end_keeps_the_sequence_distribution(tiny_model) -> None:
    prompt = [7, 8, 9, 10]
    params = SamplingParams(temperature=2.0, top_k=4)
    exact = exact_joint(tiny_model, prompt, params, 3)
    draws = 1200
    counts: dict[tuple[int, ...], int] = {}
    accepted = second_child = 0
    for i in range(draws):
        noise = PositionNoise(3_000 + i)
        verifier = functools.partial(verify_speculative, params=params, noise=noise)
        tree_verifier = functools.partial(verify_tree_speculative, params=params, noise=noise)
        steps = list(
            decode(
                TorchBackend(tiny_model),
                prompt,
                ModelTree(tiny_model),
                StopCriteria(frozenset(), 3),
                verifier,
                tree_verifier,
            )
        )
        key = tuple(t for s in steps for t in s.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(s.num_accepted for s in steps)
        second_child += sum(s.path[:1] == (1,) for s in steps)
    assert_follows_exact(counts, exact, draws)
    assert accepted > draws // 4 and second_child > 0  # drafts really accepted, second children too


class CountsOutput(StreamDrafter):
    """A scripted drafter's base: `done` counts the tokens emitted so far, to index a reference."""

    def reset(self, prompt_ids):
        self.done = 0

    def update(self, tokens, num_accepted):
        self.done += len(tokens)


def test_tree_decoding_equals_greedy_with_branches_right_and_wrong(tiny_model) -> None:
    prompt = [11, 12, 13, 14, 15, 16]
    reference = greedy_reference(tiny_model, prompt, 30)

    class BranchyDrafter(CountsOutput):
        """Root children: a wrong token, then the right chain of 3 with a wrong side branch."""

        def propose(self, max_tokens):
            right = reference[self.done : self.done + 3]
            if max_tokens < 4 or len(right) < 3:
                return Draft()
            wrong = (right[0] + 1) % TINY_VOCAB
            side = (right[1] + 1) % TINY_VOCAB
            return Draft([wrong, right[0], right[1], side, right[2]], parents=(-1, -1, 1, 1, 2))

    steps = list(decode(TorchBackend(tiny_model), prompt, BranchyDrafter(), StopCriteria(frozenset(), 30), *GREEDY))
    assert [t for s in steps for t in s.tokens] == reference
    assert any(s.path == (1, 2, 4) for s in steps)  # the deepest branch, not the first child, accepted


def test_a_backends_exact_pass_size_bounds_every_tree_by_its_nodes(tiny_model) -> None:
    """A row-exact backend verifies bitwise up to `exact_tokens` rows: the loop keeps a wider tree's
    first nodes (parents come first, so they are still a tree), whatever its depth."""
    prompt = [4, 5, 6, 4, 5]
    reference = greedy_reference(tiny_model, prompt, 24)

    class WideTree(CountsOutput):  # the right chain of 5, then 5 wrong tokens under the root: 10 nodes
        def propose(self, max_tokens):
            right = reference[self.done : self.done + 5]
            wrong = [(t + 1) % TINY_VOCAB for t in reference[self.done : self.done + 5]]
            return Draft(
                right + wrong, parents=(*chain_parents(len(right)), *([-1] * len(wrong))), evidence=tuple(range(10))
            )

    class Counting(TorchBackend):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.sizes: list[int] = []

        def forward(self, seq, token_ids, **kwargs):
            self.sizes.append(len(token_ids))
            return super().forward(seq, token_ids, **kwargs)

    backend = Counting(tiny_model, exact_tokens=4)
    steps = list(decode(backend, prompt, WideTree(), StopCriteria(frozenset(), 20), *GREEDY))
    assert [t for s in steps for t in s.tokens] == reference[:20]
    assert max(backend.sizes) == 4 and all(len(s.drafted) <= 3 for s in steps)
    assert max(len(s.path) for s in steps) == 3  # the kept nodes are the first ones: the right chain
    wide = WideTree()
    wide.reset(prompt)
    cut = wide.propose(20).first(7)
    assert cut.tokens == reference[:5] + [(t + 1) % TINY_VOCAB for t in reference[:2]]
    assert cut.parents == (-1, 0, 1, 2, 3, -1, -1) and cut.evidence == tuple(range(7)) and cut.first(99) is cut
