"""Continuous batching: several requests decoded in shared target passes.

Requests join and leave between passes. Each pass packs, for every running request, its pending
token and the part of its draft that pays, plus the prompts of requests that join (their prefill
rides along with the others' decoding, Sarathi-style), into one forward (`engine.batch`); each
request's rows are bitwise what its own pass would give, so its output equals the request alone.

Rows are shared, so drafts are cut for the whole pass, not per request: every drafted token comes
with its estimated probability of acceptance (its `reach`, from cost-aware drafting), and the pass
keeps the most probable tokens of all requests in the number that maximises the expected tokens
per second of the whole pass under the measured cost of a pass by rows:

    (sequences decoding + sum of the kept tokens' reach) / cost(rows)

On a CPU a row is dear once a pass holds a few: with eight requests, a drafted token must be
likelier than about (8 x the cost of one more row / the cost of the pass) to earn its row, so
speculation falls back to plain decoding rows when they are dear and drafts again as the batch
thins. One pass is `step()`; the server's worker thread and the benchmark call it in a loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.cost import PassCost
from leapdecode.engine.loop import SequenceRun, Step
from leapdecode.errors import InputError
from leapdecode.models.row_exact import PASS_ROWS

if TYPE_CHECKING:
    from leapdecode.drafters.base import Offer
    from leapdecode.engine.backend import Scores, TorchBackend


@dataclass(frozen=True)
class PassReport:
    """What one shared pass did."""

    sequences: int  # requests with rows in the pass
    rows: int  # tokens scored
    prefill_rows: int  # of which prompt tokens
    drafted: int  # of which drafted tokens
    emitted: int  # tokens the pass emitted, all requests together
    seconds: float


@dataclass(eq=False)
class Submission:
    """One request handed to the scheduler. `on_step` gets each step as it is accepted (on the
    scheduler's thread); `on_end` once, with the finish reason: "stop", "length", "cancelled",
    "timeout" or "error" (then `error` holds the exception)."""

    run: SequenceRun
    on_step: Callable[[Step], None]
    on_end: Callable[[str], None]
    timeout_s: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when its prefill pass began (queue time ends)

    def cancel(self) -> None:
        """Leave at the next pass (a client that went away): its rows and cache are freed there."""
        self.cancelled.set()


def allocate(offers: Sequence[Offer | None], caps: Sequence[int], base_rows: int, decoding: int, cost: PassCost,
             budget: int) -> list[list[int]]:
    """Which drafted tokens each request keeps in a pass: the most probable tokens across all
    offers (parents before children, at most `caps[i]` of request i, within `budget` rows in all)
    in the number with the most expected tokens per second, `decoding + sum(reach) / cost(rows)`,
    where `base_rows` rows (pending tokens, prompts) are there anyway. An offer without reach is
    kept whole up to its cap and the budget, before any other (None: no draft)."""
    kept: list[list[int]] = [[] for _ in offers]
    rows = base_rows
    candidates: list[tuple[float, int, int]] = []
    for i, offer in enumerate(offers):
        if offer is None:
            continue
        if offer.reach is None:
            kept[i] = list(range(max(0, min(len(offer.draft), caps[i], budget - rows))))
            rows += len(kept[i])
        else:
            candidates.extend((-r, i, t) for t, r in enumerate(offer.reach))
    candidates.sort()  # most probable first; a child never precedes its parent (lower reach, or a tie and a later index)
    chosen: list[tuple[int, int]] = []
    best, best_rate, expected = 0, decoding / cost.of(max(rows, 1)), float(decoding)
    taken: list[set[int]] = [set() for _ in offers]
    for negative_reach, i, t in candidates:
        offer = offers[i]
        assert offer is not None
        parent = offer.draft.parents[t] if offer.draft.parents is not None else t - 1
        if len(taken[i]) >= caps[i] or (parent >= 0 and parent not in taken[i]) or rows + len(chosen) >= budget:
            continue
        taken[i].add(t)
        chosen.append((i, t))
        expected -= negative_reach
        rate = expected / cost.of(rows + len(chosen))
        if rate > best_rate:
            best, best_rate = len(chosen), rate
    for i, t in chosen[:best]:
        kept[i].append(t)
    return [sorted(k) for k in kept]


class BatchScheduler:
    """Runs submitted requests in shared passes on one `TorchBackend` (see the module doc)."""

    def __init__(self, backend: TorchBackend, cost: PassCost, *, max_batch: int = 8, max_rows: int = 128,
                 clock: Callable[[], float] = time.monotonic) -> None:
        reason = backend.batchable
        if reason is not None:
            raise InputError(reason)
        if not 1 <= max_batch <= max_rows <= PASS_ROWS:
            raise InputError(f"max_batch must be at least 1, and max_rows from max_batch to {PASS_ROWS}; got {max_batch} and {max_rows}")
        self.backend = backend
        self.cost = cost
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.clock = clock
        self.waiting: deque[Submission] = deque()
        self.running: list[Submission] = []
        self._lock = threading.Lock()
        self.wake = threading.Condition(self._lock)  # notified on submit: an idle worker sleeps on it

    def submit(self, submission: Submission) -> Submission:
        """Queue a request (any thread); it joins at a pass with room for it."""
        with self.wake:
            self.waiting.append(submission)
            self.wake.notify_all()
        return submission

    def wait_for_work(self, timeout: float) -> bool:
        """Sleep until a request is running or waiting (or `timeout` seconds pass); whether one is."""
        with self.wake:
            return self.wake.wait_for(lambda: bool(self.running or self.waiting), timeout=timeout)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self.running and not self.waiting

    def step(self) -> PassReport | None:
        """One pass: over the running requests and those that join, or the prefill of a prompt
        longer than a pass, alone (as decoding it alone would); None when there is nothing to do."""
        self._drop_leavers()
        decoding = list(self.running)
        joining, alone = self._admit()
        start = self.clock()
        report: list[PassReport] = []
        if alone is not None:
            self._guarded([alone], lambda: report.append(self._prefill_alone(alone)))
        elif decoding or joining:
            self._guarded([*decoding, *joining], lambda: report.append(self._pass(decoding, joining)))
        else:
            return None
        return dataclasses.replace(report[0], seconds=self.clock() - start) if report else None

    def _pass(self, decoding: list[Submission], joining: list[Submission]) -> PassReport:
        items, settles = self._plan(decoding, joining)
        wanted = tuple(sorted({layer for s in [*decoding, *joining] for layer in s.run.wants.get("features", ())}))
        scores = forward_batch(self.backend, items, wanted)
        emitted = 0
        for submission, score, settle in zip([*decoding, *joining], scores, settles):
            emitted += self._deliver(submission, settle(self._features_for(submission.run, score, wanted)))
        rows = sum(len(item.tokens) for item in items)
        prefill = sum(len(s.run.prompt_ids) for s in joining)
        return PassReport(len(items), rows, prefill, rows - prefill - len(decoding), emitted, 0.0)

    def _prefill_alone(self, submission: Submission) -> PassReport:
        run = submission.run
        seq, scores = self.backend.prefill(run.prompt_ids, **run.wants)
        emitted = self._deliver(submission, run.begin(self.backend, seq, scores))
        return PassReport(1, len(run.prompt_ids), len(run.prompt_ids), 0, emitted, 0.0)

    def _deliver(self, submission: Submission, step: Step) -> int:
        submission.on_step(step)
        if submission.run.done:
            self._end(submission, step.finish_reason or "length")
        return len(step.tokens)

    def _guarded(self, members: list[Submission], work: Callable[[], None]) -> None:
        """Run `work`; if it fails, every request in it ends with the error and the rest go on."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - reported to each request's on_end, which the server turns into a 500
            for submission in members:
                if submission in self.running:
                    submission.error = exc
                    self._end(submission, "error")

    def _drop_leavers(self) -> None:
        now = self.clock()
        with self._lock:
            for submission in list(self.waiting):
                if submission.cancelled.is_set():
                    self.waiting.remove(submission)
                    submission.on_end("cancelled")
        for submission in list(self.running):
            if submission.cancelled.is_set():
                self._end(submission, "cancelled")
            elif submission.timeout_s is not None and submission.started_at is not None and now - submission.started_at > submission.timeout_s:
                self._end(submission, "timeout")

    def _admit(self) -> tuple[list[Submission], Submission | None]:
        """Waiting requests that join now, oldest first, while the batch has room and their
        prompts fit the pass's rows; or, when the oldest prompt is longer than any pass, that
        request alone (its prefill is this step's pass)."""
        joining: list[Submission] = []
        rows = len(self.running)
        with self._lock:
            while self.waiting and len(self.running) + len(joining) < self.max_batch:
                prompt = len(self.waiting[0].run.prompt_ids)
                if prompt > self.max_rows and joining:
                    break  # its own pass comes next
                if prompt <= self.max_rows and rows + prompt > self.max_rows:
                    break  # waits for the next pass
                submission = self.waiting.popleft()
                submission.started_at = self.clock()
                self.running.append(submission)
                if prompt > self.max_rows:
                    return [], submission
                joining.append(submission)
                rows += prompt
        return joining, None

    def _plan(self, decoding: list[Submission], joining: list[Submission]) -> tuple[list[BatchItem], list[Callable[[Scores], Step]]]:
        """The pass's items (decoding requests, then prompts) and how each request settles its scores."""
        offered = [(s, self._offer(s)) for s in decoding]
        decoding[:] = [s for s, offer in offered if offer is not None]  # a request whose drafter failed has left
        limits = [self.backend.draft_limit(s.run.seq) for s in decoding]
        offers = [offer for _, offer in offered if offer is not None]
        caps = [len(o.draft) if exact is None else min(len(o.draft), exact) for o, exact in zip(offers, limits)]
        prompt_rows = sum(len(s.run.prompt_ids) for s in joining)
        kept = allocate(offers, caps, len(decoding) + prompt_rows, len(decoding), self.cost, max(self.max_rows, len(decoding) + prompt_rows))
        items: list[BatchItem] = []
        settles: list[Callable[[Scores], Step]] = []
        for submission, offer, keep in zip(decoding, offers, kept):
            run = submission.run
            tokens, tree = run.plan(run.take(offer, keep))
            assert run.seq is not None
            items.append(BatchItem(run.seq, tokens, tree))
            settles.append(lambda scores, run=run: run.settle(self.backend, scores))
        for submission in joining:
            run = submission.run
            seq = self.backend.new_sequence()
            items.append(BatchItem(seq, run.prompt_ids, None, last_only=True))
            settles.append(lambda scores, run=run, seq=seq: run.begin(self.backend, seq, scores))
        return items, settles

    def _offer(self, submission: Submission) -> Offer | None:
        """The request's draft offer; a drafter that fails ends its own request only (None)."""
        try:
            return submission.run.offer(self.backend.draft_limit(submission.run.seq))
        except Exception as exc:  # noqa: BLE001 - the request ends with its error; the others' pass goes on
            submission.error = exc
            self._end(submission, "error")
            return None

    @staticmethod
    def _features_for(run: SequenceRun, scores: Scores, wanted: tuple[int, ...]) -> Scores:
        """A request's scores with only the states its drafter asked for (the pass computed the
        union of every request's)."""
        from leapdecode.engine.backend import Scores

        own = run.wants.get("features", ())
        if own == wanted or scores.features is None:
            return scores if own else Scores(scores.logits)
        width = scores.features.shape[-1] // len(wanted)
        columns = [slice(wanted.index(layer) * width, (wanted.index(layer) + 1) * width) for layer in own]
        return Scores(scores.logits, features=torch.cat([scores.features[:, c] for c in columns], dim=-1))

    def _end(self, submission: Submission, reason: str) -> None:
        """Take a request out of the batch: its cache is freed with its run."""
        if submission in self.running:
            self.running.remove(submission)
        submission.run.seq = None
        submission.on_end(reason)
