"""Per-request drafters for engines that batch requests in slots (vLLM), without their request ids.

vLLM asks a proposer for drafts once per step with the batch as arrays: row i is a *slot*, holding
some request's tokens (`token_ids[i, :num_tokens[i]]`: prompt, then every token emitted so far).
Slots are reordered between steps, a finished request's slot is given to a new one, and a
preempted request comes back in another slot. Our drafters are incremental and per request (an
n-gram table, a suffix automaton), so each row must find *its own request's* drafter:

- a drafter remembers what it was fed: how many tokens, the first `HEAD` and the last `TAIL` of them;
- it serves a row if the row starts with its first tokens and holds its last ones at the same
  place (O(1) per row, whatever the context's length);
- the row's previous drafter is tried first (the usual case), then the others (a reordered
  batch), else a new drafter is built from the row's tokens (a new request, or one evicted);
- with a `StepCost`, the time between calls is fitted as the engine's step cost (decode steps
  only), which cost-aware drafters read to cut their drafts;
- drafters unused for `idle_steps` steps are dropped (finished requests; `Drafter.finish` is
  called, so a shared suffix index keeps their output), and at most `capacity` are kept (oldest
  use dropped first): memory is bounded.

Each drafter is driven by the engine's contract (`engine.drafting`): started with the row's
tokens, then per step an offer, and the next step's new tokens heard as its pass's result.

A request is never served another request's drafter unless both hold the same first and last
tokens at the same length — and even then only the drafts differ: the engine verifies every
drafted token, so the output cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from leapdecode.engine.drafting import DraftContext, Drafter, PassResult, Request
from leapdecode.engine.pass_plan import offer_alone
from leapdecode.integrations.step_cost import StepCost

HEAD = 32  # tokens compared at a row's start
TAIL = 32  # tokens compared at the end of what a drafter was fed


@dataclass
class _Tracked:
    """One request's drafter and a fingerprint of what it has been fed."""

    drafter: Drafter
    length: int
    head: np.ndarray  # [min(length, HEAD)]
    tail: np.ndarray  # [min(length, TAIL)]
    last_draft: list[int] = field(default_factory=list)
    last_step: int = 0
    offered: bool = False  # an offer whose pass it has not heard of yet
    kept: list[int] = field(default_factory=list)  # the indices of that offer's tokens drafted to the engine

    def serves(self, row: np.ndarray, num_tokens: int) -> bool:
        """Whether `row[:num_tokens]` continues exactly what this drafter was fed (by its ends)."""
        if self.length > num_tokens or self.length < len(self.head):
            return False
        return bool(
            np.array_equal(row[: len(self.head)], self.head)
            and np.array_equal(row[self.length - len(self.tail) : self.length], self.tail)
        )

    def feed(self, row: np.ndarray, num_tokens: int) -> None:
        """Give the drafter the row's tokens it has not seen; those it drafted last time and
        that came back first were accepted."""
        new = row[self.length : num_tokens].tolist()
        if new and self.offered:
            accepted = 0
            while accepted < min(len(self.last_draft), len(new) - 1) and self.last_draft[accepted] == new[accepted]:
                accepted += 1
            # the engine scored the draft it was given (a chain: the part kept of the offer)
            self.drafter.hear(PassResult(new, accepted, self.kept))
        elif new or self.offered:
            # tokens it never offered for, or an offer whose row came back as it was (another
            # request holding the same tokens took this drafter): it ends, and starts from the row
            self.drafter.finish()
            self.drafter.start(Request(row[:num_tokens].tolist()))
        self.offered = False
        self.length = num_tokens
        if len(self.head) < HEAD:
            self.head = row[: min(num_tokens, HEAD)].copy()
        self.tail = row[max(0, num_tokens - TAIL) : num_tokens].copy()


class SlotDrafters:
    """Drafts for every row of a slot-batched engine step, one drafter per request (module doc)."""

    def __init__(
        self,
        new_drafter: Callable[[], Drafter],
        *,
        max_tokens: int,
        max_len: int,
        capacity: int = 1024,
        idle_steps: int = 64,
        cost: StepCost | None = None,
    ) -> None:
        if max_tokens < 1 or capacity < 1 or idle_steps < 1:
            raise ValueError("max_tokens, capacity and idle_steps must be at least 1")
        self.new_drafter = new_drafter
        self.max_tokens = max_tokens
        self.max_len = max_len  # no draft may reach past the engine's longest sequence
        self.capacity = capacity
        self.idle_steps = idle_steps
        self.cost = cost  # the engine's step time, fitted here, read by cost-aware drafters
        self.step = 0
        self.by_slot: dict[int, _Tracked] = {}
        self.tracked: list[_Tracked] = []
        self.built = 0  # drafters built from a row's tokens (new requests, or ones not recognised)

    def propose(
        self, sampled: Sequence[Sequence[int]], num_tokens: np.ndarray, token_ids: np.ndarray
    ) -> list[list[int]]:
        """One step: `sampled[i]` are the tokens slot i's request emitted this step (empty: a
        partial prefill, which gets no draft); `token_ids[i, :num_tokens[i]]` is its whole stream."""
        elapsed = self.cost.elapsed() if self.cost is not None else None
        self.step += 1
        # 1. find each row's drafter and feed it what the step emitted
        rows: list[tuple[_Tracked, int] | None] = []  # per slot: its drafter and draft room, or no draft
        claimed: set[int] = set()  # ids of drafters already serving a row this step
        scored, decode_only = 0, True  # tokens the step just ended scored, and whether it only decoded
        for slot, emitted in enumerate(sampled):
            n = int(num_tokens[slot])
            room = min(self.max_tokens, self.max_len - n)
            if not len(emitted) or room <= 0:
                rows.append(None)
                decode_only = False
                continue
            built = self.built
            tracked = self._find(slot, token_ids[slot], n, claimed)  # row: [max_len]
            claimed.add(id(tracked))
            if self.built > built:
                decode_only = False  # a new request: its prefill was in the step
            scored += 1 + len(tracked.last_draft)
            tracked.feed(token_ids[slot], n)
            tracked.last_step = self.step
            rows.append((tracked, room))
        # 2. the step just ended: fit its time if it only decoded
        if self.cost is not None:
            if elapsed is not None and decode_only and scored:
                self.cost.observe(scored, elapsed)
            self.cost.rows = len(claimed)
        # 3. draft
        drafts: list[list[int]] = []
        for row in rows:
            if row is None:
                drafts.append([])
                continue
            tracked, room = row
            # cut as the scheduler cuts a pass of one request's own: by the curve the offer was
            # priced with (a cost-aware drafter's: the step cost fitted here), within the room
            offer, tracked.kept = offer_alone(tracked.drafter, DraftContext(room), room)
            tracked.last_draft = list(offer.draft.subset(tracked.kept).tokens)
            tracked.offered = True
            drafts.append(tracked.last_draft)
        self._evict(claimed)
        if self.cost is not None:
            self.cost.call_ended()
        return drafts

    def _find(self, slot: int, row: np.ndarray, n: int, claimed: set[int]) -> _Tracked:
        """This row's request's drafter: the slot's last one, another that fits, or a new one."""
        tracked = self.by_slot.get(slot)
        if tracked is None or id(tracked) in claimed or not tracked.serves(row, n):
            # a reordered batch: the longest fitting drafter knows the most
            fits = [t for t in self.tracked if id(t) not in claimed and t.serves(row, n)]
            tracked = max(fits, key=lambda t: t.length) if fits else None
        if tracked is None:
            drafter = self.new_drafter()
            drafter.start(Request(row[:n].tolist()))
            tracked = _Tracked(drafter, n, row[: min(n, HEAD)].copy(), row[max(0, n - TAIL) : n].copy())
            self.tracked.append(tracked)
            self.built += 1
        self.by_slot[slot] = tracked
        return tracked

    def _evict(self, used: set[int]) -> None:
        """Drop drafters idle too long, then the least recently used beyond `capacity`."""
        keep = [t for t in self.tracked if id(t) in used or self.step - t.last_step < self.idle_steps]
        keep.sort(key=lambda t: t.last_step, reverse=True)
        alive = {id(t) for t in keep[: self.capacity]}
        for t in self.tracked:
            if id(t) not in alive:
                t.drafter.finish()  # most often a finished request: a shared index keeps its output
        self.tracked = keep[: self.capacity]
        self.by_slot = {slot: t for slot, t in self.by_slot.items() if id(t) in alive}
