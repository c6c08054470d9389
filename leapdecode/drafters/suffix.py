"""Suffix drafting (SuffixDecoding, arXiv 2411.04975; SAM-Decoding, arXiv 2411.10666): copy what
followed the longest earlier match of the stream's suffix, in this request and, when shared, in
earlier requests' outputs.

A suffix automaton of the stream finds the longest suffix of the stream that occurred before,
exactly and of any length, in amortised O(1) per appended token (prefix-lookup drafters try a
few fixed n-gram lengths; this one never misses a longer match). The draft continues that
earlier occurrence (usually the latest one); its length grows with the match length
(`factor × match + offset`, at most `k`): a long match is strong evidence that the text is
being copied, a one-token match is weak.

`SuffixIndex` holds finished requests' outputs in one automaton, shared by the requests of one
decoder when asked (`suffix:shared=true`): then one request's drafts can copy what the model
wrote for another — the point of SuffixDecoding on agentic and repetitive workloads, and a
leak of text between users of one server, so it is off unless asked. Its memory is bounded:
past `max_tokens` stored tokens, the oldest outputs are dropped (the automaton is rebuilt from
the newer half, amortised O(1) per token).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from leapdecode.drafters.base import Draft, Drafter


class SuffixAutomaton:
    """The online suffix automaton of a token stream (Blumer et al. 1985): every substring of the
    stream is a path from state 0. States are kept in parallel lists (`next`, `link`, `length`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]  # transitions
        self.link: list[int] = [-1]  # suffix link: the state of the longest suffix in another class
        self.length: list[int] = [0]  # the length of the state's longest string
        # Two end positions of the state's strings: `end` the latest recorded, `before` an earlier
        # one (-1: none known). Recorded when the state is created or cloned, or gains the new
        # position as the new state's suffix link; other ends are not tracked (that is O(1)).
        self.end: list[int] = [-1]
        self.before: list[int] = [-1]
        self.last = 0  # the state of the whole stream

    def __len__(self) -> int:
        return len(self.tokens)

    def _new_state(self, length: int, link: int, end: int, before: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.end.append(end)
        self.before.append(before)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        position = len(self.tokens)
        self.tokens.append(token)
        nxt, link, length = self.next, self.link, self.length
        cur = self._new_state(length[self.last] + 1, 0, position, -1, {})
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
                self.before[q], self.end[q] = self.end[q], position
            else:
                clone = self._new_state(length[p] + 1, link[q], position, self.end[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def repeat(self) -> tuple[int, int]:
        """The longest suffix of the stream that also ends earlier: (its length, an earlier end
        position); (0, -1) when even the last token is new."""
        state = self.link[self.last] if self.last else -1
        if state <= 0:
            return 0, -1
        return self.length[state], self.before[state]

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Matching another stream against this one: from (state, matched length) of the other's
        longest suffix found here, to the same after it appends `token`."""
        nxt, link = self.next, self.link
        while state and token not in nxt[state]:
            state = link[state]
            matched = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0

    def continuation(self, end: int, count: int) -> list[int]:
        """Up to `count` tokens after position `end`, stopping at a separator (a negative id); past
        the stream's end the copy repeats itself (a match that overlaps its own continuation)."""
        out: list[int] = []
        tokens, size = self.tokens, len(self.tokens)
        for i in range(count):
            pos = end + 1 + i
            token = tokens[pos] if pos < size else out[pos - size]
            if token < 0:
                break
            out.append(token)
        return out


class Match(NamedTuple):
    length: int  # tokens of the stream's suffix matched
    end: int  # where the earlier occurrence ends, in the automaton's stream
    shared: bool  # found in the shared index of earlier requests
    source: SuffixAutomaton  # the automaton it was found in


class SuffixIndex:
    """Earlier requests' outputs in one suffix automaton, separated so that no match crosses two
    outputs; at most `max_tokens` tokens, dropping the oldest outputs first."""

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.stored = 0  # tokens in `outputs`
        self.automaton = SuffixAutomaton()
        self.version = 0  # changes whenever the automaton does: matchers re-match then
        self._separator = -1
        self._lock = threading.Lock()

    def add(self, output: Sequence[int]) -> None:
        """Store a finished request's output (its last `max_tokens` tokens)."""
        output = list(output)[-self.max_tokens :]
        if not output:
            return
        with self._lock:
            self.outputs.append(output)
            self.stored += len(output)
            if self.stored > self.max_tokens:
                while self.stored > self.max_tokens // 2 and len(self.outputs) > 1:
                    self.stored -= len(self.outputs.popleft())
                self.automaton = SuffixAutomaton()
                for kept in self.outputs:
                    self._append(kept)
            else:
                self._append(output)
            self.version += 1

    def _append(self, output: list[int]) -> None:
        self.automaton.extend(output)
        self.automaton.append(self._separator)  # unique: no match runs across two outputs
        self._separator -= 1


class SuffixDrafter(Drafter):
    """Drafts the continuation of the longest earlier match of the stream's suffix (module doc)."""

    def __init__(
        self, k: int = 16, factor: float = 1.0, offset: float = 0.0, min_match: int = 1,
        index: SuffixIndex | None = None, window: int = 64,
    ) -> None:
        self.k, self.factor, self.offset, self.min_match = k, factor, offset, min_match
        self.index = index  # shared by the requests of one decoder; None: this request only
        self.window = window  # tokens re-matched against the index when it changed
        self.local = SuffixAutomaton()
        self.prompt_length = 0
        # The stream's suffix matched in the index: (the automaton matched against, its version
        # then, state, matched length). Stepping an automaton that grew since is safe (states are
        # only ever added), and a stale match is re-made from the last `window` tokens.
        self._shared: tuple[SuffixAutomaton | None, int, int, int] = (None, -1, 0, 0)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.local = SuffixAutomaton()
        self.local.extend(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self._shared = (None, -1, 0, 0)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.local.extend(tokens)
        automaton, version, state, matched = self._shared
        if automaton is not None:
            for token in tokens:
                state, matched = automaton.step(state, matched, token)
            self._shared = (automaton, version, state, matched)

    def match(self) -> Match | None:
        """The longer of this request's own match and the shared index's (this request's wins a tie)."""
        length, end = self.local.repeat()
        best = Match(length, end, False, self.local) if length else None
        if self.index is not None:
            automaton, version, state, matched = self._shared
            if automaton is not self.index.automaton or version != self.index.version:
                automaton, version = self.index.automaton, self.index.version  # a change in between: re-matched next time
                state, matched = 0, 0
                for token in self.local.tokens[-self.window :]:
                    state, matched = automaton.step(state, matched, token)
                self._shared = (automaton, version, state, matched)
            if matched > length:
                best = Match(matched, automaton.end[state], True, automaton)
        return best if best is not None and best.length >= self.min_match else None

    def propose(self, max_tokens: int) -> Draft:
        found = self.match()
        if found is None:
            return Draft()
        count = min(self.k, max_tokens, int(self.factor * found.length + self.offset))
        tokens = found.source.continuation(found.end, count)
        # evidence for cost-aware cutting: how long the match is, and where it was found
        evidence = min(found.length, 16) * 2 + found.shared
        return Draft(tokens, evidence=(evidence,) * len(tokens))

    def finish(self) -> None:
        if self.index is not None:
            self.index.add(self.local.tokens[self.prompt_length :])
