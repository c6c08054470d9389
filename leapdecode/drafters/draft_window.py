"""Which tokens of its stream a draft model's cache holds: all of them, or a window.

A draft model's numerics never change the output (the target decides every token), so its cache
may leave tokens out. With a window, the draft model reads at most `window` tokens of the context
before its first pass: the first `SINK_TOKENS` (attention sinks, StreamingLLM 2309.17453; TriForce
drafts over such a partial cache) and the last ones, so a long prompt's draft prefill stays short.
The tokens between are a hole: its cache position c holds stream token c plus the holes before
c. A request that starts from a kept cache's copy (`engine.prefix_cache`) takes its holes too,
and reads at most `window` of the rest. Until the cache's first read, its window follows the
stream: a draft model that starts late reads no more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from leapdecode.engine.prefix_cache import Hole, Taken

SINK_TOKENS = 4  # a windowed context keeps its first tokens too: attention sinks


@dataclass
class DraftWindow:
    """The stream tokens a draft model's cache skips (`holes`), made by its `window` (0: none)."""

    window: int = 0
    holes: tuple[Hole, ...] = ()
    # until the cache's first read: where the read starts, how many tokens it reads at most, and
    # the holes before it (None once it has read: its holes are fixed)
    _next: tuple[int, int, tuple[Hole, ...]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.window and self.window <= 2 * SINK_TOKENS:
            raise ValueError(f"window must be 0 (the whole context) or more than {2 * SINK_TOKENS}, got {self.window}")

    @property
    def skip(self) -> int:
        """The stream tokens the cache skips (its holes')."""
        return sum(count for _, count in self.holes)

    def unstarted(self, length: int) -> None:
        """No cache yet over a stream of `length` tokens: its first pass will read the first
        SINK_TOKENS and the last `window` - SINK_TOKENS."""
        self._next = (SINK_TOKENS, self.window - SINK_TOKENS, ())
        self.grown(length)

    def copied(self, taken: Taken, length: int) -> None:
        """The cache is a kept one's copy of the stream's first `taken.length` of `length` tokens:
        its holes, and at most `window` of the rest to read."""
        self._next = (taken.length, self.window, taken.holes)
        self.grown(length)

    def grown(self, length: int) -> None:
        """The stream now holds `length` tokens: a cache that has not read yet will read the
        window of them all."""
        if self._next is not None:
            start, reads, before = self._next
            count = length - start - reads
            self.holes = (*before, (start, count)) if self.window and count > 0 else before

    def read(self) -> None:
        """The cache has read past its start: its holes are fixed."""
        self._next = None

    def covered(self, held: int) -> int:
        """The stream tokens a cache of `held` positions accounts for: those it holds and its holes."""
        return held + self.skip

    def unread(self, stream: Sequence[int], held: int | None, drafted: list[int]) -> list[int]:
        """What a cache of `held` positions (None: not started) lacks of stream + drafted, without
        copying the stream (work proportional to the tail); before its first pass, the stream but
        its hole."""
        if held is None and self.holes:
            ((start, count),) = self.holes
            return [*stream[:start], *stream[start + count :], *drafted]
        start, n = self.covered(held or 0), len(stream)
        return drafted[start - n :] if start >= n else [*stream[start:], *drafted]
