"""Lookahead decoding (Fu et al., arXiv 2402.02057) as a tree drafter of the shared loop.

Every pass scores two branches together, as one token tree (`merge_paths`; the tree mask of
`leapdecode.engine.tree` is the paper's combined mask):

- the **lookahead branch**: a 2D window of Jacobi guesses, `w` columns by `n`-1 levels. Level 0
  is one chain [pending token, g1 .. g(w-1)]; the cell at level j, column c continues the cell
  at level j-1 in the same column, so each column's trajectory (level 0 up to level j) reads as
  consecutive positions after the pending token's first c tokens. The model's prediction at
  the top cell of each column closes an n-gram [level 0 .. level n-2, prediction] that goes to
  the pool; then the levels shift down and the predictions become the new top level (the first
  n-2 passes only fill the levels).
- the **verification branch**: up to `g` pooled n-grams that start with the pending token, most
  recent first; their other n-1 tokens are drafted, and the tree verifier keeps the longest one
  the model agrees with.

Every node of the tree is an ordinary drafted token, so acceptance is exactly greedy (or, when
sampling, exact speculative sampling over the tree): the method is lossless. With `anpd`, the
pool is ANPD's n-gram module: Jacobi n-grams are added to it, and its own chain over the
context joins the verification branch, so that the two sources feed one another.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.ngram import NGramModule
from leapdecode.drafters.tree_builder import merge_paths
from leapdecode.engine.drafting import Draft, Needs, PassResult


def lookahead_paths(levels: Sequence[Sequence[int]]) -> list[list[int]]:
    """The lookahead window's cells as token paths after the pending token, column by column,
    level by level: cell (j, c) is level 0's columns 1..c followed by levels 1..j of column c.
    Level 0, column 0 is the pending token itself (the root), so it has no path."""
    width = len(levels[0])
    paths = []
    for column in range(width):
        chain = list(levels[0][1 : column + 1])
        for level in range(len(levels)):
            if level > 0:
                chain.append(levels[level][column])
            paths.append(list(chain))
    return paths


class LookaheadDrafter(StreamDrafter):
    """A Jacobi window and its n-gram pool in one tree per pass (module doc); its settings are
    checked once, where the method string is parsed (`methods.parallel.Lookahead`)."""

    needs = Needs(predictions=True)

    def __init__(self, w: int = 2, n: int = 3, g: int = 2, anpd: bool = False, seed: int = 0) -> None:
        self.w = w
        self.n = n
        self.g = g
        self.anpd = anpd
        self.seed = seed

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.stream = list(prompt_ids)
        rng = random.Random(self.seed)
        self.levels: list[list[int]] = [[rng.choice(self.stream) for _ in range(self.w)]]  # the window, level 0 first
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}  # first token -> n-grams' tails, oldest first
        self.module = NGramModule(self.n) if self.anpd else None
        if self.module is not None:
            self.module.initialise(prompt_ids)
        self.cells: list[int] | None = None  # node of each column's top cell in the last pass (-1: the root)

    def _candidates(self, max_tokens: int) -> list[list[int]]:
        pending = self.stream[-1]
        tails = [list(t) for t in reversed(self.pool.get(pending, {}))][: self.g]
        if self.module is not None:
            tails.insert(0, self.module.predict_chain(self.stream[-(self.n - 1) :], self.n - 1))
        return [t[:max_tokens] for t in tails]

    def propose(self, max_tokens: int) -> Draft:
        self.levels[0][0] = self.stream[-1]
        window = lookahead_paths(self.levels)
        # The window joins the pass only while its deepest cell fits in what is left to generate.
        use_window = max(len(p) for p in window) <= max_tokens
        paths = self._candidates(max_tokens) + (window if use_window else [])
        draft, ends = merge_paths(paths)
        first, top = len(paths) - len(window), len(self.levels) - 1
        self.cells = [ends[first + c * len(self.levels) + top] for c in range(self.w)] if use_window else None
        return draft

    def hear(self, result: PassResult) -> None:
        if result.kept is not None and self.cells is not None:
            # the window's cells renumbered among the scored nodes; a window not scored whole is left out
            where = {full: new for new, full in enumerate(result.kept)} | {-1: -1}
            self.cells = [where[c] for c in self.cells] if all(c in where for c in self.cells) else None
        if result.predicted is not None:
            self._grow(result.predicted)
        self.update(result.tokens, result.accepted)

    def _grow(self, predicted: Sequence[int]) -> None:
        """The window's next level: the target's prediction after each column's top cell."""
        if self.cells is None:  # the window was left out of this pass
            return
        new_level = [predicted[c + 1] for c in self.cells]  # the prediction after each column's top cell
        if len(self.levels) == self.n - 1:  # the window is full: every column closes an n-gram
            for column, token in enumerate(new_level):
                self._add([level[column] for level in self.levels] + [token])
            self.levels = self.levels[1:]
        self.levels.append(new_level)

    def _add(self, gram: list[int]) -> None:
        tails = self.pool.setdefault(gram[0], OrderedDict())
        tails.pop(tuple(gram[1:]), None)
        tails[tuple(gram[1:])] = None  # most recent last
        while len(tails) > max(self.g, 1):  # only the g most recent are ever drafted
            tails.popitem(last=False)
        if self.module is not None:
            self.module.add_ngram(gram)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.stream.extend(tokens)
        if self.module is not None:
            self.module.extend(tokens)
