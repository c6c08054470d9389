"""Finished requests' KV caches, kept for the next request that begins with the same tokens.

A chat resends its whole history every turn, and every request to a server begins with the same
system prompt: the prompt tokens a kept cache already holds need no prefill, and on a CPU a
prompt token costs about as much as a decoding row. This is what vLLM's automatic prefix caching
and llama-server's `cache_prompt` do.

It is lossless because the backends that share passes are row-exact: a token's keys and values
are bitwise the same whether a prompt's prefill (in chunks of any size), a decoding pass or a
tree pass's kept path computed them. A cache cut back to a prefix the new prompt shares is
therefore bitwise the cache a fresh prefill of that prefix builds.

An entry is one finished sequence: its tokens and its cache. A request takes a copy of the
longest prefix it shares with any entry, so many requests can start from one entry (a system
prompt, or `n` parallel chats). An entry is an exact-size copy (what a growing cache holds in
room to grow is not kept), and entries beyond a budget of tokens go, least recently used first.

A draft model's cache may leave out part of its stream (a window of a long prompt: the draft
model's numerics never change the output, the target's do): its entry says which tokens it skips
(`holes`), and a request that shares those tokens and more starts from it with the same holes.
The target's entries have none.

Requests still running are sources too (`plan_start`): a request that joins while another with
the same system prompt is being prefilled waits for that prefill to pass the shared tokens and
starts from a copy, so a burst of requests with one long system prompt prefills it once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from leapdecode.engine.cache import CacheState
from leapdecode.errors import InputError

Hole = tuple[int, int]  # (start, count): the stream tokens [start, start + count) a cache skips


@dataclass
class PrefixEntry:
    """A kept sequence: `tokens` are what its cache accounts for, in order; it holds them all but
    its `holes` (`seq.length == size`)."""

    tokens: tuple[int, ...]
    seq: CacheState
    holes: tuple[Hole, ...] = ()

    @property
    def size(self) -> int:
        """The tokens its cache holds."""
        return len(self.tokens) - sum(count for _, count in self.holes)


class Taken(NamedTuple):
    """A copy of a kept prefix: `seq` holds the prompt's first `length` tokens but the `holes`."""

    seq: CacheState
    length: int
    holes: tuple[Hole, ...] = ()


def usable(holes: Sequence[Hole], shared: int) -> tuple[int, tuple[Hole, ...]]:
    """How many leading tokens a cache with `holes` serves a prompt sharing `shared` of its
    tokens, and the holes among them: all `shared`, or back to the start of a hole `shared` ends
    inside (past a hole, the cache's next position holds the token after it)."""
    before: list[Hole] = []
    for start, count in holes:
        if shared < start + count:
            return (min(shared, start), tuple(before))
        before.append((start, count))
    return shared, tuple(before)


def reach(holes: Sequence[Hole], positions: int) -> int:
    """How many leading tokens the first `positions` positions of a cache with `holes` account
    for (a hole that begins where they end is not counted)."""
    tokens = positions
    for start, count in holes:
        if start >= tokens:
            break
        tokens += count
    return tokens


def held(holes: Sequence[Hole], length: int) -> int:
    """The cache positions a cache with `holes` fills for its first `length` tokens (`length` not
    inside a hole)."""
    return length - sum(count for start, count in holes if start + count <= length)


def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share: a binary search on slice equality, so a few
    comparisons run in C, not a Python step per token."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; the answer is at most high
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class RunningSource:
    """A running request's cache as a prefix source: `tokens` in order, the first `ready` of which
    its cache `seq` holds now (a prompt being prefilled holds fewer than it will)."""

    tokens: tuple[int, ...]
    ready: int
    seq: CacheState


@dataclass(frozen=True)
class PrefixStart:
    """Where a prompt starts: `length` tokens from running source `source` (its index), or from
    the kept cache (None); `wait`: that source's prefill has yet to reach `length`."""

    length: int
    source: int | None
    wait: bool


def plan_start(
    prompt: Sequence[int], kept: int, running: Sequence[RunningSource], wait_tokens: int
) -> PrefixStart | None:
    """The longest prefix of `prompt` to start from: `kept` tokens from the kept cache or what a
    running request's cache holds now; or, where a prompt being prefilled will hold at least
    `wait_tokens` more than that, a wait for it. None: nothing to share. At least the prompt's
    last token is left to prefill (its pass gives the first new token)."""
    wanted = tuple(prompt)
    cap = len(wanted) - 1
    now, now_source = min(kept, cap), None
    later, later_source = 0, None
    for index, source in enumerate(running):
        shared = min(shared_prefix(source.tokens, wanted), cap)
        if min(shared, source.ready) > now:
            now, now_source = min(shared, source.ready), index
        if shared > source.ready and shared > later:
            later, later_source = shared, index
    if later_source is not None and later - now >= wait_tokens:
        return PrefixStart(later, later_source, wait=True)
    return PrefixStart(now, now_source, wait=False) if now > 0 else None


class PrefixCache:
    """Kept sequences by their tokens, at most `max_tokens` tokens in all. Safe to share between
    threads (a library `Decoder` may be)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise InputError(f"a prefix cache needs room for at least one token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.entries: list[PrefixEntry] = []  # least recently used first
        self.tokens = 0  # held by the entries
        self.hits = 0  # requests that started from a kept prefix
        self.hit_tokens = 0  # prompt tokens they did not prefill
        self._lock = threading.Lock()

    def take(self, prompt: Sequence[int], fork: Callable[[CacheState, int], CacheState]) -> Taken | None:
        """A new cache holding the longest prefix of `prompt` that an entry serves, its length
        and the holes it skips; None when no entry shares a token. At least the prompt's last
        token is left to prefill: its pass gives the first new token. `fork(seq, n)`: a copy of
        `seq`'s first `n` positions (if it fails, nothing is counted)."""
        with self._lock:
            best, length = self._longest(tuple(prompt))
            if best is None:
                return None
            length, holes = usable(best.holes, length)
            copy = fork(best.seq, held(holes, length))
            self.entries.remove(best)
            self.entries.append(best)  # the most recently used
            self.hits += 1
            self.hit_tokens += length
            return Taken(copy, length, holes)

    def longest(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` `take` would copy now (0: none)."""
        with self._lock:
            return self._longest(tuple(prompt))[1]

    def _longest(self, wanted: tuple[int, ...]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the most leading tokens with `wanted` and how many, at most all but
        its last (None, 0: none shares a token). Under the lock."""
        best: PrefixEntry | None = None
        length = 0
        for entry in self.entries:
            shared, holes = usable(entry.holes, min(shared_prefix(entry.tokens, wanted), len(wanted) - 1))
            if shared > length and held(holes, shared) > 0:
                best, length = entry, shared
        return best, length

    def keep(
        self,
        tokens: Sequence[int],
        seq: CacheState,
        snapshot: Callable[[CacheState, int], CacheState],
        holes: Sequence[Hole] = (),
    ) -> None:
        """Keep a finished sequence whose cache holds `tokens` but its `holes` (or as many as its
        `seq.length` positions hold), cut to the budget: `snapshot(seq, n)`, an exact-size copy of
        its first `n` positions, so the budget is what the entries hold. An entry that serves it
        all already is only refreshed, and entries it serves whole go; then the least recently
        used go until the budget holds."""
        count, kept_holes = usable(holes, min(len(tokens), reach(holes, min(seq.length, self.max_tokens))))
        if count == 0:
            return
        kept = PrefixEntry(tuple(tokens[:count]), seq, kept_holes)
        with self._lock:
            for entry in self.entries:
                if serves(entry, kept):
                    self.entries.remove(entry)
                    self.entries.append(entry)
                    return
            kept.seq = snapshot(seq, kept.size)
            self.entries = [e for e in self.entries if not serves(kept, e)]
            self.entries.append(kept)
            self.tokens = sum(e.size for e in self.entries)
            while self.tokens > self.max_tokens:
                self.tokens -= self.entries.pop(0).size

    def clear(self) -> None:
        """Drop every entry (their caches are freed)."""
        with self._lock:
            self.entries.clear()
            self.tokens = 0


def serves(entry: PrefixEntry, other: PrefixEntry) -> bool:
    """Whether `entry` serves every prompt `other` does: `other`'s tokens begin `entry`'s, with the
    same holes among them."""
    length = len(other.tokens)
    return (
        len(entry.tokens) >= length
        and shared_prefix(entry.tokens, other.tokens) == length
        and usable(entry.holes, length) == (length, other.holes)
    )
