"""Prompt lookup decoding (LLMA, arXiv 2304.04487): copy what followed the latest earlier
occurrence of the stream's last few tokens.

The simplest reference drafter. An index from each m-gram (m in [min_ngram, max_ngram]) to the
position where it last ended is kept up to date as tokens arrive, so a lookup is a dictionary
access per m, not a scan of the context. Grams ending at the newest position are indexed one
token late, so that a lookup of the current suffix finds an *earlier* occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence

from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import Draft


class PromptLookupDrafter(StreamDrafter):
    def __init__(self, k: int = 10, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.k = k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._last_end: list[dict[tuple[int, ...], int]] = []  # index m - min_ngram
        self._indexed = 0  # grams ending before this position are in the index

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.tokens = list(prompt_ids)
        self._last_end = [{} for _ in range(self.min_ngram, self.max_ngram + 1)]
        self._indexed = 0
        self._index_up_to(len(self.tokens) - 1)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.tokens.extend(tokens)
        self._index_up_to(len(self.tokens) - 1)

    def _index_up_to(self, stop: int) -> None:
        tokens = self.tokens
        for end in range(self._indexed, stop):
            for m in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._last_end[m - self.min_ngram][tuple(tokens[end - m + 1 : end + 1])] = end
        self._indexed = max(self._indexed, stop)

    def propose(self, max_tokens: int) -> Draft:
        tokens = self.tokens
        limit = min(self.k, max_tokens)
        if limit <= 0:
            return Draft()
        for m in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            end = self._last_end[m - self.min_ngram].get(tuple(tokens[-m:]))
            if end is None:
                continue
            # Copy what followed; past the stream's end the copied text repeats itself.
            draft: list[int] = []
            for i in range(limit):
                pos = end + 1 + i
                draft.append(tokens[pos] if pos < len(tokens) else draft[pos - len(tokens)])
            return Draft(draft)
        return Draft()
