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

Requests still running are sources too (`plan_start`): a request that joins while another with
the same system prompt is being prefilled waits for that prefill to pass the shared tokens and
starts from a copy, so a burst of requests with one long system prompt prefills it once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from leapdecode.engine.cache import CacheState
from leapdecode.errors import InputError


@dataclass
class PrefixEntry:
    """A kept sequence: `tokens` are what its cache holds, in order (`seq.length == len(tokens)`)."""

    tokens: tuple[int, ...]
    seq: CacheState


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

    def take(
        self, prompt: Sequence[int], fork: Callable[[CacheState, int], CacheState]
    ) -> tuple[CacheState, int] | None:
        """A new cache holding the longest prefix of `prompt` that an entry holds, and its length;
        None when no entry shares a token. At least the prompt's last token is left to prefill:
        its pass gives the first new token. `fork(seq, n)`: a copy of `seq`'s first `n` tokens
        (if it fails, nothing is counted)."""
        with self._lock:
            best, length = self._longest(tuple(prompt))
            if best is None:
                return None
            copy = fork(best.seq, length)
            self.entries.remove(best)
            self.entries.append(best)  # the most recently used
            self.hits += 1
            self.hit_tokens += length
            return copy, length

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
            shared = min(shared_prefix(entry.tokens, wanted), len(wanted) - 1)
            if shared > length:
                best, length = entry, shared
        return best, length

    def keep(self, tokens: Sequence[int], seq: CacheState, snapshot: Callable[[CacheState, int], CacheState]) -> None:
        """Keep a finished sequence whose cache holds `tokens`, or their first `seq.length`, cut to
        the budget: `snapshot(seq, n)`, an exact-size copy of its first `n` tokens, so the budget
        is what the entries hold. An entry that holds it all already is only refreshed, and entries
        that are prefixes of it go (it serves whatever they served); then the least recently used
        go until the budget holds."""
        count = min(len(tokens), seq.length, self.max_tokens)
        if count == 0:
            return
        kept = tuple(tokens[:count])
        with self._lock:
            for entry in self.entries:
                if len(entry.tokens) >= count and shared_prefix(entry.tokens, kept) == count:
                    self.entries.remove(entry)
                    self.entries.append(entry)
                    return
            entry = PrefixEntry(kept, snapshot(seq, count))
            self.entries = [e for e in self.entries if shared_prefix(e.tokens, kept) < len(e.tokens)]
            self.entries.append(entry)
            self.tokens = sum(len(e.tokens) for e in self.entries)
            while self.tokens > self.max_tokens:
                self.tokens -= len(self.entries.pop(0).tokens)

    def clear(self) -> None:
        """Drop every entry (their caches are freed)."""
        with self._lock:
            self.entries.clear()
            self.tokens = 0
