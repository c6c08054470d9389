"""When generation ends: EOS / end-of-turn ids, stop strings, and the token budget.

Finish reasons follow the OpenAI API: "stop" (an end-of-turn id or a stop string) and
"length" (max_new_tokens reached).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopCriteria:
    """Decides how many of a step's new tokens to keep and whether generation is over."""

    def __init__(
        self,
        eos_token_ids: frozenset[int] | set[int],
        max_new_tokens: int,
        stop_strings: Sequence[str] = (),
        tokenizer: Any = None,
    ) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokenizer = tokenizer
        # A stop string of L characters lies within the last L tokens (each token is >= 1 char).
        self._window = max((len(s) for s in self.stop_strings), default=0) + 1

    def cut(self, generated: Sequence[int], new_tokens: Sequence[int]) -> tuple[int, str | None]:
        """Return (how many of `new_tokens` to keep, finish reason or None to go on)."""
        room = self.max_new_tokens - len(generated)
        for i, token in enumerate(new_tokens):
            if i >= room:
                return i, "length"
            if token in self.eos_token_ids:
                return i + 1, "stop"
            if self.stop_strings and self._ends_with_stop(generated, new_tokens[: i + 1]):
                return i + 1, "stop"
        if len(generated) + len(new_tokens) >= self.max_new_tokens:
            return len(new_tokens), "length"
        return len(new_tokens), None

    def _ends_with_stop(self, generated: Sequence[int], new_tokens: Sequence[int]) -> bool:
        tail = (list(generated[-self._window :]) + list(new_tokens))[-self._window :]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(stop in text for stop in self.stop_strings)


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """The text before the first stop string, as the OpenAI API returns it."""
    cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
