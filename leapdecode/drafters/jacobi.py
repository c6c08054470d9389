"""Jacobi decoding (Santilli et al., arXiv 2305.10427) as a drafter of the shared loop.

Greedy decoding is the fixed point of y_i = argmax p(. | x, y_<i) over a block of future tokens.
Jacobi iteration guesses the block, scores it in one pass, and replaces every guess by the
model's prediction at its position; the prefix that already agrees with the model is exactly the
greedy output, so the loop's greedy verifier accepts it and the rest of the updated block is the
next guess. Two variants:

- `sliding` (the Gauss-Seidel/Jacobi hybrid): after each pass the block slides past what was
  accepted and is topped up to `block` guesses, so every pass looks `block` tokens ahead;
- `block` (plain parallel Jacobi): the block is fixed; each pass scores only its unresolved
  tail, and a new block starts when it is complete.

New guesses (the initial block, and the top-up) come from `init`: `repeat` the last token,
`random` tokens drawn from the context, or `ngram` chains from an n-gram table of the context
(ANPD's module), falling back to repeating.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.ngram import NGramModule
from leapdecode.engine.drafting import Draft, Needs, PassResult


class JacobiDrafter(StreamDrafter):
    """Guesses a block and replaces each guess by the target's prediction there (module doc); its
    settings are checked once, where the method string is parsed (`methods.parallel.Jacobi`)."""

    needs = Needs(predictions=True)

    def __init__(self, block: int = 3, mode: str = "sliding", init: str = "repeat", seed: int = 0) -> None:
        self.block = block
        self.mode = mode
        self.init = init
        self.seed = seed

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.stream = list(prompt_ids)
        self.rng = random.Random(self.seed)
        self.module = NGramModule(3) if self.init == "ngram" else None
        if self.module is not None:
            self.module.initialise(prompt_ids)
        self.guess: list[int] = []  # guesses for the tokens after the next emitted one
        self.left = 0  # `block` mode: positions of the current block not yet emitted
        self.drafted = 0
        self.predicted: list[int] = []

    def _fresh(self, count: int) -> list[int]:
        """`count` new guesses continuing the stream and the current guesses."""
        context = self.stream + self.guess
        if self.init == "random":
            return [self.rng.choice(self.stream) for _ in range(count)]
        chain = self.module.predict_chain(context, count) if self.module is not None else []
        return chain + [(chain or context)[-1]] * (count - len(chain))

    def propose(self, max_tokens: int) -> Draft:
        if self.mode == "block":
            if self.left <= 0:  # a new block: the next emitted token and `block` guesses after it
                self.guess, self.left = [], self.block + 1
            size = self.left - 1
        else:
            size = self.block
        if len(self.guess) < size:
            self.guess += self._fresh(size - len(self.guess))
        self.guess = self.guess[:size]
        draft = self.guess[: max(0, max_tokens)]
        self.drafted = len(draft)
        return Draft(list(draft))

    def hear(self, result: PassResult) -> None:
        if result.kept is not None:
            self.drafted = len(result.kept)  # a chain: its kept part is a prefix
        self.predicted = list(result.predicted or ())
        self.update(result.tokens, result.accepted)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.stream.extend(tokens)
        if self.module is not None:
            self.module.extend(tokens)
        # The Jacobi update: the model's predictions after the first rejected guess onwards are
        # the new guesses for the positions after the emitted bonus token.
        self.guess = self.predicted[num_accepted + 1 : self.drafted + 1]
        self.left -= len(tokens)
        self.predicted = []
