"""ANPD's token-level N-gram module with Multi-Level N-gram (MLN) fallback, and its drafter.

Paper: Adaptive N-gram Parallel Decoding (arXiv 2404.08698), Algorithms 1 and 2.

The module keeps, for every order m in [2, N], a table from the m-1 preceding tokens to the
tokens seen after them. Its three operations:
- initialise from the prompt's token ids,
- update with every token the target emits (O(N) per token),
- query with the last N-1 tokens: try order N, then N-1, ... 2; the first order that has seen
  the context wins (MLN).

Choice rule when a context was followed by several tokens: the most frequent wins; among equally
frequent ones, the one seen most recently. The winner is kept up to date on every update, so a
query is a dictionary lookup per order and never rescans the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import Draft, Evidence


@dataclass(frozen=True, slots=True)
class Prediction:
    token: int
    order: int  # the n of the n-gram that matched (MLN level)
    count: int  # how often the context was followed by `token`


class _Continuations:
    """The tokens seen after one context, with counts; `best` follows the choice rule."""

    __slots__ = ("counts", "best")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.best = -1

    def add(self, token: int) -> None:
        count = self.counts.pop(token, 0) + 1
        self.counts[token] = count  # re-inserted last: the dict's order is recency order
        # `token` is the most recent, so it also wins a tie in count.
        if self.best < 0 or count >= self.counts[self.best]:
            self.best = token

    def top(self, m: int) -> list[tuple[int, int]]:
        """Up to m (token, count) pairs by the choice rule: count, then recency."""
        ranked = sorted(enumerate(self.counts.items()), key=lambda item: (item[1][1], item[0]), reverse=True)
        return [pair for _, pair in ranked[:m]]


class NGramModule:
    """Token-level n-gram tables for orders 2..n, updated online."""

    def __init__(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"n must be at least 2, got {n}")
        self.n = n
        self.tokens: list[int] = []
        self._tables: list[dict[tuple[int, ...], _Continuations]] = [{} for _ in range(n - 1)]  # index m-2

    def initialise(self, token_ids: Sequence[int]) -> None:
        self.tokens = []
        self._tables = [{} for _ in range(self.n - 1)]
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            self.update(token)

    def update(self, token: int) -> None:
        """Record `token` after each of its 1..n-1 preceding tokens."""
        tokens = self.tokens
        tokens.append(token)
        end = len(tokens) - 1
        for order in range(2, min(self.n, end + 1) + 1):
            key = tuple(tokens[end - order + 1 : end])
            table = self._tables[order - 2]
            entry = table.get(key)
            if entry is None:
                entry = table[key] = _Continuations()
            entry.add(token)

    def add_ngram(self, gram: Sequence[int]) -> None:
        """Count an n-gram seen outside the stream (e.g. a Jacobi trajectory): each of its tokens
        after the tokens before it in the n-gram, for every order that fits."""
        for end in range(1, len(gram)):
            for order in range(2, min(self.n, end + 1) + 1):
                key = tuple(gram[end - order + 1 : end])
                entry = self._tables[order - 2].get(key)
                if entry is None:
                    entry = self._tables[order - 2][key] = _Continuations()
                entry.add(gram[end])

    def query(self, context: Sequence[int]) -> Prediction | None:
        """Predict the token after `context` (its last n-1 tokens), highest order first."""
        for order in range(min(self.n, len(context) + 1), 1, -1):
            entry = self._tables[order - 2].get(tuple(context[len(context) - order + 1 :]))
            if entry is not None:
                return Prediction(entry.best, order, entry.counts[entry.best])
        return None

    def candidates(self, context: Sequence[int], m: int) -> list[tuple[int, float]]:
        """Up to m distinct next tokens with an estimated probability, highest order first:
        the top continuations of the longest seen context, then lower orders' for the rest (MLN).
        The probability is the token's share of its context's continuations."""
        out: dict[int, float] = {}
        weight = 1.0
        for order in range(min(self.n, len(context) + 1), 1, -1):
            entry = self._tables[order - 2].get(tuple(context[len(context) - order + 1 :]))
            if entry is None:
                continue
            total = sum(entry.counts.values())
            for token, count in entry.top(m):
                if token not in out and len(out) < m:
                    out[token] = weight * count / total
            if len(out) >= m:
                break
            weight *= 0.5  # a shorter context's guess is worth less than a longer one's
        return list(out.items())

    def predict_chain(self, context: Sequence[int], k: int) -> list[int]:
        """Chain up to `k` queries, each on the context extended by the previous predictions."""
        return [p.token for p in self.predictions(context, k)]

    def predictions(self, context: Sequence[int], k: int) -> list[Prediction]:
        """`predict_chain` with each token's order and count (its evidence)."""
        window = list(context[-(self.n - 1) :])
        chain: list[Prediction] = []
        for _ in range(k):
            prediction = self.query(window)
            if prediction is None:
                break
            chain.append(prediction)
            window = window[1:] + [prediction.token] if len(window) == self.n - 1 else window + [prediction.token]
        return chain


class AnpdDrafter(StreamDrafter):
    """Drafts K tokens by chaining N-gram queries over the prompt and everything generated."""

    def __init__(self, n: int = 5, k: int = 7) -> None:
        self.k = k
        self.module = NGramModule(n)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.module.initialise(prompt_ids)

    def propose(self, max_tokens: int) -> Draft:
        tokens = self.module.tokens
        chain = self.module.predictions(tokens[-(self.module.n - 1) :], min(self.k, max_tokens))
        # evidence: the matched order, and whether the context was seen followed by it more than once
        return Draft(
            [p.token for p in chain], evidence=tuple(Evidence("ngram", p.order * 2 + (p.count > 1)) for p in chain)
        )

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.module.extend(tokens)
