"""Grow a token tree best-first: the shared way tree drafters turn scored candidates into a draft.

A drafter supplies `children(path)`: candidate next tokens after the drafted `path`, each with a
probability estimate. The tree keeps the `nodes` paths with the highest product of
probabilities (each node's ancestors are in the tree, so parents come first), no deeper than
`depth`. With one candidate per node it is a chain.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from leapdecode.drafters.base import Draft

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
