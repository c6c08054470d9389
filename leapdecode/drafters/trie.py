"""Trie drafter (Lookahead's multi-branch retrieval, arXiv 2312.12728): a trie of every n-gram of
the prompt and of everything generated, with counts; the latest context's longest match in the
trie hands over its whole subtree of observed continuations, best branches first.

Every token is the end of `window` n-grams (those starting at each of the last `window`
positions); keeping the trie nodes of the open n-grams makes an update O(window). A draft
matches the last `max_match` .. 1 tokens (longest first) and takes the most frequent branches
below the match, up to `nodes` tokens and `depth` levels. Counts from the prompt are weighted by
`prompt_weight`: in the tasks this tool targets (code edits, summaries, RAG) the output copies
the prompt more reliably than it repeats itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.tree_builder import best_first_tree
from leapdecode.engine.drafting import Draft


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class TokenTrie:
    """Counts of every n-gram (n <= window) of a token stream, as a trie."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.root = _Node()
        self._open: list[_Node] = []  # nodes of the n-grams that end at the last token

    def add(self, token: int, weight: int = 1) -> None:
        advanced = []
        for node in [self.root, *self._open[: self.window - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += weight
            advanced.append(child)
        self._open = advanced  # shortest n-gram first

    def find(self, context: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in context:
            node = node.children.get(token) if node is not None else None
        return node


class TrieDrafter(StreamDrafter):
    def __init__(
        self, nodes: int = 8, depth: int = 4, window: int = 12, max_match: int = 4, prompt_weight: int = 2
    ) -> None:
        if not 1 <= max_match < window:
            raise ValueError(f"need 1 <= max_match < window, got {max_match}, {window}")
        self.nodes = nodes
        self.depth = depth
        self.window = window
        self.max_match = max_match
        self.prompt_weight = prompt_weight
        self.trie = TokenTrie(window)
        self.tokens: list[int] = []

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.trie = TokenTrie(self.window)
        self.tokens = []
        for token in prompt_ids:
            self._add(token, self.prompt_weight)

    def _add(self, token: int, weight: int) -> None:
        self.tokens.append(token)
        self.trie.add(token, weight)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        for token in tokens:
            self._add(token, 1)

    def propose(self, max_tokens: int) -> Draft:
        for length in range(min(self.max_match, len(self.tokens)), 0, -1):
            match = self.trie.find(self.tokens[-length:])
            if match is not None and match.children:
                break
        else:
            return Draft()
        below: dict[tuple[int, ...], _Node] = {(): match}

        def children(path: tuple[int, ...]) -> list[tuple[int, float]]:
            node = below[path]
            total = sum(child.count for child in node.children.values())
            ranked = sorted(node.children.items(), key=lambda item: item[1].count, reverse=True)[: self.nodes]
            for token, child in ranked:
                below[path + (token,)] = child
            return [(token, child.count / total) for token, child in ranked]

        # the trie holds n-grams of at most `window` tokens: the match uses `length` of them
        return best_first_tree(children, self.nodes, min(self.depth, max_tokens, self.window - length))
