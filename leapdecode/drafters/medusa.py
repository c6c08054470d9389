"""Medusa-1 drafting (Cai et al. 2401.10774): extra heads on the target's last hidden state.

Head i reads the target's final-norm state h_n and predicts the token at n+i+2; the target's own
LM head predicts n+1, the bonus token the loop emits before asking for a draft. The loop hands
over the states of the positions it just verified (`hear`): the last
of them is the state whose next token is the stream's last token, so the heads on that one row
draft the tokens after it. No extra target pass, and a proposal costs the heads on one row,
whatever the context's length.

Chain: each head's argmax. Tree: each head's top `width` tokens, the same under every parent
(Medusa's Cartesian-product tree), grown best-first by the product of the heads' probabilities
(`best_first_tree`), at most `nodes` tokens and `depth` levels. Drafts are deterministic (q is
None); a token's evidence is its own head's probability in tenths (0-9), for cost-aware cutting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.tree_builder import best_first_tree
from leapdecode.engine.drafting import Draft, Evidence, Needs, PassResult
from leapdecode.heads.medusa import MedusaHeads


def _bucket(prob: float) -> Evidence:
    """A probability's evidence: one level per tenth."""
    return Evidence("head", min(9, int(10 * prob)))


class MedusaDrafter(StreamDrafter):
    """Drafts with Medusa heads from the target's last hidden state (`Needs.features`: the
    final norm's output, index `num_layers_of_target` into Hugging Face's `hidden_states`)."""

    def __init__(
        self,
        heads: MedusaHeads,
        num_layers_of_target: int,
        *,
        tree: bool = False,
        nodes: int = 16,
        depth: int | None = None,
        width: int = 4,
    ) -> None:
        num_heads = heads.config.num_heads
        if num_layers_of_target < 1:
            raise ValueError(f"num_layers_of_target must be >= 1, got {num_layers_of_target}")
        if depth is not None and not 1 <= depth <= num_heads:
            raise ValueError(f"depth must be between 1 and the number of heads ({num_heads}), got {depth}")
        if nodes < 1 or width < 1:
            raise ValueError(f"nodes and width must be >= 1, got nodes={nodes}, width={width}")
        self.heads = heads
        self.needs = Needs(features=(num_layers_of_target,))
        self.tree = tree
        self.nodes = nodes
        self.depth = num_heads if depth is None else depth
        self.width = width
        self.last: torch.Tensor | None = None  # [1, hidden]: the target's state before the stream's last token

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.last = None

    def hear(self, result: PassResult) -> None:
        # features: [rows, hidden]; only the last row is ever read, so only it is kept (a copy, so
        # that the pass's whole tensor is not held).
        states = result.features
        if states is not None:
            device = next(iter(self.heads.parameters()), states).device
            self.last = states[-1:].to(device=device, dtype=self.heads.dtype, copy=True)  # [1, hidden]
        self.update(result.tokens, result.accepted)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        pass  # `hear` takes the state before the bonus token

    def propose(self, max_tokens: int) -> Draft:
        depth = min(self.depth, max_tokens)
        if depth <= 0 or self.last is None:
            return Draft()
        probs, ids = self._top(depth, self.width if self.tree else 1)
        if not self.tree:
            return Draft([row[0] for row in ids], evidence=tuple(_bucket(row[0]) for row in probs))
        return self._tree(probs, ids, depth)

    def _top(self, count: int, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """Each of the first `count` heads' `k` best tokens with their probabilities, in one
        host transfer."""
        assert self.last is not None
        with torch.inference_mode():
            probs, ids = self.heads.top(self.last, count, k)  # [count, k] each
            both = torch.stack((probs.double(), ids.double())).tolist()  # [2, count, k]; ids < 2**53: exact
        return both[0], [[int(token) for token in row] for row in both[1]]

    def _tree(self, probs: list[list[float]], ids: list[list[int]], depth: int) -> Draft:
        """The best-first tree over the heads' candidates: a node at level l takes head l's."""

        def children(path: tuple[int, ...]) -> list[tuple[int, float]]:
            return list(zip(ids[len(path)], probs[len(path)]))

        draft = best_first_tree(children, self.nodes, depth)
        if not draft.tokens or draft.parents is None:
            return Draft()
        prob_of = [dict(zip(ids[level], probs[level])) for level in range(depth)]
        levels: list[int] = []
        evidence: list[Evidence] = []
        for token, parent in zip(draft.tokens, draft.parents):
            levels.append(0 if parent < 0 else levels[parent] + 1)
            evidence.append(_bucket(prob_of[levels[-1]][token]))
        return Draft(draft.tokens, parents=draft.parents, evidence=tuple(evidence))
