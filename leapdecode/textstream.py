"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding token by token breaks multi-byte characters and tokenizers that merge spaces, so each
delta is computed from a short window of recent tokens (not the whole output), and text that
still ends in an incomplete character is held back until the next tokens complete it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self._prefix = 0  # window start: decoded for context only
        self._read = 0  # tokens up to here have been emitted as text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def push(self, tokens: Iterable[int]) -> str:
        """Add tokens; return the new text they complete (possibly empty)."""
        self.tokens.extend(tokens)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return after[len(before) :]
