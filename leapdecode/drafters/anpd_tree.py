"""ANPD with a token tree: several continuations from the same N-gram module, merged into one tree.

A chain ANPD draft is lost from its first wrong token. Here each node's context (the stream plus
the node's path) is queried for its top `width` continuations across MLN levels, with their
empirical probabilities; the `nodes` most probable paths (no deeper than `depth`) form the
tree, verified in one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.ngram import NGramModule
from leapdecode.drafters.tree_builder import best_first_tree
from leapdecode.engine.drafting import Draft


class AnpdTreeDrafter(StreamDrafter):
    def __init__(self, n: int = 5, nodes: int = 8, depth: int = 4, width: int = 3) -> None:
        self.module = NGramModule(n)
        self.nodes = nodes
        self.depth = depth
        self.width = width

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.module.initialise(prompt_ids)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.module.extend(tokens)

    def propose(self, max_tokens: int) -> Draft:
        context = self.module.tokens[-(self.module.n - 1) :]

        def children(path: tuple[int, ...]) -> list[tuple[int, float]]:
            window = (context + list(path))[-(self.module.n - 1) :]
            return self.module.candidates(window, self.width)

        return best_first_tree(children, self.nodes, min(self.depth, max_tokens))
