"""Suffix drafting (SuffixDecoding, arXiv 2411.04975; SAM-Decoding, arXiv 2411.10666): copy what
followed earlier matches of the stream's suffix, in this request and, when shared, in earlier
requests' outputs.

A suffix automaton of the stream finds the longest suffix of the stream that occurred before,
exactly and of any length, in amortised O(1) per appended token (prefix-lookup drafters try a
few fixed n-gram lengths; this one never misses a longer match). The draft continues what
followed; its length grows with the match length (`factor × match + offset`, at most `k`): a
long match is strong evidence that the text is being copied, a one-token match is weak.

The automaton also counts how often each substring occurred (a walk up the new position's
suffix links, bounded by `COUNT_WALK`), so a match that occurred several times and went on
differently drafts a *tree*, as SuffixDecoding does: the continuations ranked
by estimated probability (how often each followed the match, times its parent's), best first,
down to `min_prob`. Every suffix of the stream that occurred before is a candidate match — a
long one seen once, a shorter one seen often — and the one whose draft has the most expected
accepted tokens (the sum of the probabilities) wins. With `tree=False` the draft is the most
probable path only (what vLLM, which verifies chains, gets).

`SuffixIndex` holds finished requests' outputs in one automaton, shared by the requests of one
decoder when asked (`suffix:shared=true`): then one request's drafts can copy what the model
wrote for another — the point of SuffixDecoding on agentic and repetitive workloads, and a
leak of text between users of one server, so it is off unless asked. Its memory is bounded:
past `max_tokens` stored tokens, the oldest outputs are dropped (the automaton is rebuilt from
the newer half, amortised O(1) per token).
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import Draft, Evidence

# Occurrence counts are kept up to date by walking the new position's suffix-link path, at most
# this many states: only long runs of one repeated token make the path longer, and then the
# shortest strings' counts lag (a draft's estimate, never its correctness, depends on them).
COUNT_WALK = 256


class SuffixAutomaton:
    """The online suffix automaton of a token stream (Blumer et al. 1985): every substring of the
    stream is a path from state 0. States are kept in parallel lists (`next`, `link`, `length`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]  # transitions
        self.link: list[int] = [-1]  # suffix link: the state of the longest suffix in another class
        self.length: list[int] = [0]  # the length of the state's longest string
        self.count: list[int] = [0]  # occurrences of the state's strings (ends), see COUNT_WALK
        self.last = 0  # the state of the whole stream

    def __len__(self) -> int:
        return len(self.tokens)

    def _new_state(self, length: int, link: int, nxt: dict[int, int], count: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        self.tokens.append(token)
        nxt, link, length = self.next, self.link, self.length
        cur = self._new_state(length[self.last] + 1, 0, {}, 1)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new_state(length[p] + 1, link[q], dict(nxt[q]), self.count[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        # the new end position is an occurrence of every suffix that occurred before
        count, state = self.count, link[cur]
        for _ in range(COUNT_WALK):
            if state <= 0:
                break
            count[state] += 1
            state = link[state]
        self.last = cur

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def repeat(self) -> tuple[int, int]:
        """The longest suffix of the stream that also ends earlier: (its state, its length);
        (0, 0) when even the last token is new."""
        state = self.link[self.last] if self.last else 0
        return (state, self.length[state]) if state > 0 else (0, 0)

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

    def draft_tree(self, state: int, open_end: bool, limit: int, min_prob: float, tree: bool) -> Speculation:
        """The continuations of `state`'s strings, best first by estimated probability, at most
        `limit` tokens, none below `min_prob`; `tree=False`: only the most probable path.
        `open_end`: the state's strings end the stream too, an occurrence with no continuation
        yet (not counted); past the stream's end such a match repeats itself (the copy overlaps
        its own continuation)."""
        nxt, count = self.next, self.count
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        ratios: list[float] = []
        depth: list[int] = []
        # (-probability, order, token, state, parent index, ratio to the parent, period)
        heap: list[tuple[float, int, int, int, int, float, int]] = []
        order = 0

        def push(node: int, prob: float, parent: int, total: int) -> None:
            nonlocal order
            options = [(count[child], token, child) for token, child in nxt[node].items() if token >= 0]
            if not tree and options:
                options = [max(options)]
            for seen, token, child in options:
                ratio = min(seen / total, 1.0)
                if prob * ratio >= min_prob:
                    heapq.heappush(heap, (-prob * ratio, order, token, child, parent, ratio, 0))
                    order += 1

        push(state, 1.0, -1, max(count[state] - open_end, 1))
        while heap and len(tokens) < limit:
            neg, _, token, node, parent, ratio, period = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg)
            ratios.append(ratio)
            depth.append(depth[parent] + 1 if parent >= 0 else 1)
            if open_end and node == self.last:  # the stream's end: the copy repeats its own path
                period = period or depth[index]
                source = index
                for _ in range(period - 1):
                    source = parents[source]
                heapq.heappush(heap, (neg, order, tokens[source], node, index, 1.0, period))
                order += 1
            else:
                push(node, -neg, index, count[node])
        return Speculation(tokens, parents, probs, ratios)

    def speculate(
        self,
        state: int,
        matched: int,
        open_end: bool,
        limit: int,
        factor: float,
        offset: float,
        min_match: int,
        min_prob: float,
        tree: bool,
    ) -> tuple[int, Speculation]:
        """SuffixDecoding's choice of match: for every suffix of the stream found here (`state`
        holds the longest, `matched` tokens long; shorter ones are its suffix links), its draft of
        at most `factor × length + offset` tokens (and `limit`); the one with the highest score wins (the longer
        match on a tie). Returns (the match's length, its draft)."""
        best, best_length = Speculation([], [], [], []), 0
        length = matched
        while state > 0 and length >= min_match:
            size = min(limit, int(factor * length + offset + 1e-6))
            if size <= best.score:  # a shorter match drafts no more: it cannot win
                break
            draft = self.draft_tree(state, open_end, size, min_prob, tree)
            if draft.score > best.score:
                best, best_length = draft, length
            state = self.link[state]
            length = self.length[state]
        return best_length, best


class Speculation(NamedTuple):
    tokens: list[int]
    parents: list[int]  # -1: follows the stream
    probs: list[float]  # estimated probability that the token is accepted (its path's)
    ratios: list[float]  # the same, given its parent was

    @property
    def score(self) -> float:
        """The expected number of accepted tokens."""
        return sum(self.probs)


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


def match_evidence(length: int, ratio: float, shared: bool) -> int:
    """Cost-aware cutting's evidence for a drafted token: the match's length, where it was found,
    and how often the token followed its parent there (all of the time, most, or less)."""
    share = 2 if ratio > 0.99 else 1 if ratio >= 0.5 else 0
    return (min(length, 16) * 2 + shared) * 3 + share


class SuffixDrafter(StreamDrafter):
    """Drafts the most probable continuations of an earlier match of the stream's suffix, in this
    request or in the shared index of earlier outputs (module doc)."""

    def __init__(
        self,
        k: int = 16,
        factor: float = 1.0,
        offset: float = 0.0,
        min_match: int = 1,
        index: SuffixIndex | None = None,
        window: int = 64,
        min_prob: float = 0.1,
        tree: bool = True,
    ) -> None:
        self.k, self.factor, self.offset, self.min_match = k, factor, offset, min_match
        self.min_prob, self.tree = min_prob, tree
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

    def shared_match(self) -> tuple[SuffixAutomaton, int, int] | None:
        """(the index's automaton, the state of the stream's longest suffix found there, its
        length), or None without an index."""
        if self.index is None:
            return None
        automaton, version, state, matched = self._shared
        if automaton is not self.index.automaton or version != self.index.version:
            automaton, version = self.index.automaton, self.index.version  # a change in between: re-match
            state, matched = 0, 0
            for token in self.local.tokens[-self.window :]:
                state, matched = automaton.step(state, matched, token)
            self._shared = (automaton, version, state, matched)
        return automaton, state, matched

    def propose(self, max_tokens: int) -> Draft:
        limit = min(self.k, max_tokens)
        if limit <= 0:
            return Draft()

        def speculate(automaton: SuffixAutomaton, state: int, matched: int, open_end: bool) -> tuple[int, Speculation]:
            return automaton.speculate(
                state, matched, open_end, limit, self.factor, self.offset, self.min_match, self.min_prob, self.tree
            )

        length, best = speculate(self.local, *self.local.repeat(), True)
        shared = False
        found = self.shared_match()
        if found is not None:
            automaton, state, matched = found
            other_length, other = speculate(automaton, state, matched, False)
            if other.score > best.score:  # this request's own match wins a tie
                length, best, shared = other_length, other, True
        if not best.tokens:
            return Draft()
        evidence = tuple(Evidence("suffix", match_evidence(length, ratio, shared)) for ratio in best.ratios)
        if not self.tree:
            return Draft(best.tokens, evidence=evidence)
        return Draft(best.tokens, parents=tuple(best.parents), evidence=evidence)

    def finish(self) -> None:
        if self.index is not None:
            self.index.add(self.local.tokens[self.prompt_length :])
