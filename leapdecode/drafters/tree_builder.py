"""Build token trees: grown best-first from scored candidates, or merged from given paths.

A drafter supplies `children(path)`: candidate next tokens after the drafted `path`, each with a
probability estimate. The tree keeps the `nodes` paths with the highest product of
probabilities (each node's ancestors are in the tree, so parents come first), no deeper than
`depth`. With one candidate per node it is a chain.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from leapdecode.engine.drafting import Draft

Children = Callable[[tuple[int, ...]], list[tuple[int, float]]]


def best_first_tree(children: Children, nodes: int, depth: int) -> Draft:
    if nodes <= 0 or depth <= 0:
        return Draft()
    order = itertools.count()  # ties: first proposed first
    heap: list[tuple[float, int, int, tuple[int, ...]]] = []  # (-score, tie, parent index, path)

    def push(path: tuple[int, ...], parent: int, score: float) -> None:
        seen: set[int] = set()
        for token, prob in children(path):
            if token not in seen and prob > 0:
                seen.add(token)
                heapq.heappush(heap, (-score * prob, next(order), parent, path + (token,)))

    push((), -1, 1.0)
    tokens: list[int] = []
    parents: list[int] = []
    while heap and len(tokens) < nodes:
        neg_score, _, parent, path = heapq.heappop(heap)
        tokens.append(path[-1])
        parents.append(parent)
        if len(path) < depth:
            push(path, len(tokens) - 1, -neg_score)
    return Draft(tokens, parents=tuple(parents))


def merge_paths(paths: list[list[int]], nodes: int | None = None) -> tuple[Draft, list[int]]:
    """Merge token paths (each continuing the last emitted token) into one tree, sharing common
    prefixes so that siblings differ. Paths are taken in order while the tree has room for all
    of a path's new nodes (`nodes`: no bound when None). Returns the draft and, for each path,
    the index of its last node (-1: the path is empty, or did not fit)."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent index, token) -> node index
    ends: list[int] = []

    def new_nodes(path: list[int]) -> int:
        node = -1
        for i, token in enumerate(path):
            if (node, token) not in child:
                return len(path) - i
            node = child[(node, token)]
        return 0

    for path in paths:
        if not path or (nodes is not None and len(tokens) + new_nodes(path) > nodes):
            ends.append(-1)
            continue
        node = -1
        for token in path:
            found = child.get((node, token))
            if found is None:
                found = child[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = found
        ends.append(node)
    return (Draft(tokens, parents=tuple(parents)) if tokens else Draft()), ends
