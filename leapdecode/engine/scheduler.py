"""Continuous batching: several requests decoded in shared target passes.

Requests join and leave between passes. Each pass packs, for every running request, its pending
token and the part of its draft that pays, plus the prompts of requests that join (their prefill
rides along with the others' decoding, Sarathi-style), into one forward (`engine.batch`); each
request's rows are bitwise what its own pass would give, so its output equals the request alone.

Rows are shared, so drafts are cut for the whole pass, not per request: every drafted token comes
with its estimated probability of acceptance (its `reach`, from cost-aware drafting), and the pass
keeps the most probable tokens of all requests in the number that maximises the expected tokens
per second of the whole pass under the measured cost of a pass by rows (`engine.cost.allocate`,
the cut cost-aware drafting makes for one request, over all of them):

    (sequences decoding + sum of the kept tokens' reach) / cost(rows)

On a CPU a row is dear once a pass holds a few: with eight requests, a drafted token must be
likelier than about (8 x the cost of one more row / the cost of the pass) to earn its row, so
speculation falls back to plain decoding rows when they are dear and drafts again as the batch
thins. One pass is `step()`; the server's worker thread and the benchmark call it in a loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.cost import PassCost, allocate
from leapdecode.engine.loop import SequenceRun, Step
from leapdecode.errors import InputError
from leapdecode.models.row_exact import PASS_ROWS

logger = logging.getLogger("leapdecode")

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

    @torch.inference_mode()
    def step(self) -> PassReport | None:
        """One pass: over the running requests and those that join, or the prefill of a prompt
        that does not fit a pass with the others, alone (as decoding it alone would); None when
        there is nothing to do."""
        self._drop_leavers()
        decoding = list(self.running)
        joining, alone = self._admit()
        start = self.clock()
        if alone is not None:
            report = self._isolated(alone, lambda: self._prefill_alone(alone))
        elif decoding or joining:
            report = self._pass(decoding, joining)
        else:
            return None
        return dataclasses.replace(report, seconds=self.clock() - start) if report is not None else None

    def fail_all(self, error: BaseException) -> None:
        """End every running and waiting request with `error` (the caller's loop failed)."""
        with self._lock:
            waiting = list(self.waiting)
            self.waiting.clear()
        for submission in [*self.running, *waiting]:
            submission.error = error
            self._end(submission, "error")

    def _pass(self, decoding: list[Submission], joining: list[Submission]) -> PassReport | None:
        """Plan, score and settle one shared pass; a request whose drafting, verifying or
        callbacks fail leaves with its error, the others go on (a failed forward ends them all)."""
        planned = [(s, p) for s in decoding if (p := self._isolated(s, lambda s=s: self._plan_decoding(s))) is not None]
        drafting = self._allocate(planned, joining)
        members = [s for s, _ in drafting] + joining
        items = [item for _, item in drafting] + [BatchItem(self.backend.new_sequence(), s.run.prompt_ids, None, last_only=True) for s in joining]
        if not items:
            return None
        wanted = tuple(sorted({layer for s in members for layer in s.run.wants.get("features", ())}))
        try:
            scores = forward_batch(self.backend, items, wanted)
        except Exception as exc:  # noqa: BLE001 - the pass failed: each of its requests ends with the error
            for submission in members:
                submission.error = exc
                self._end(submission, "error")
            return None
        emitted = 0
        for submission, item, score in zip(members, items, scores):
            emitted += self._isolated(submission, lambda s=submission, i=item, sc=score: self._settle(s, i, sc, wanted)) or 0
        rows = sum(len(item.tokens) for item in items)
        prefill = sum(len(s.run.prompt_ids) for s in joining)
        return PassReport(len(items), rows, prefill, rows - prefill - len(drafting), emitted, 0.0)

    def _settle(self, submission: Submission, item: BatchItem, scores: Scores, wanted: tuple[int, ...]) -> int:
        own = self._features_for(submission.run, scores, wanted)
        run = submission.run
        step = run.begin(self.backend, item.seq, own) if item.last_only else run.settle(self.backend, own)
        return self._deliver(submission, step)

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

    def _isolated(self, submission: Submission, work: Callable[[], Any]) -> Any:
        """`work()` for one request; if it fails, that request ends with the error (None)."""
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - reported to the request's on_end, which the server turns into a 500
            submission.error = exc
            self._end(submission, "error")
            return None

    def _drop_leavers(self) -> None:
        now = self.clock()
        with self._lock:
            cancelled = [s for s in self.waiting if s.cancelled.is_set()]
            for submission in cancelled:
                self.waiting.remove(submission)
        for submission in cancelled:  # callbacks outside the lock: they may submit
            self._end(submission, "cancelled")
        for submission in list(self.running):
            if submission.cancelled.is_set():
                self._end(submission, "cancelled")
            elif submission.timeout_s is not None and submission.started_at is not None and now - submission.started_at > submission.timeout_s:
                self._end(submission, "timeout")

    def _admit(self) -> tuple[list[Submission], Submission | None]:
        """Waiting requests that join now, oldest first, while the batch has room and their
        prompts fit the pass's rows; or, when the oldest prompt fits no pass with the others (or
        none at all), that request alone (its prefill is this step's pass)."""
        joining: list[Submission] = []
        rows = len(self.running)
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch:
                prompt = len(self.waiting[0].run.prompt_ids)
                fits = rows + prompt <= self.max_rows
                if not fits and joining:
                    break  # the next pass takes it
                submission = self.waiting.popleft()
                submission.started_at = self.clock()
                self.running.append(submission)
                if not fits:
                    return [], submission
                joining.append(submission)
                rows += prompt
        return joining, None

    def _plan_decoding(self, submission: Submission) -> tuple[Offer, int]:
        """A decoding request's offer and the most drafted tokens its pass may verify exactly."""
        run = submission.run
        exact = self.backend.draft_limit(run.seq)
        offer = run.offer(exact)
        return offer, len(offer.draft) if exact is None else min(len(offer.draft), exact)

    def _allocate(self, planned: list[tuple[Submission, tuple[Offer, int]]], joining: list[Submission]) -> list[tuple[Submission, BatchItem]]:
        """Cut the decoding requests' offers for the pass (`allocate`) and build their items; a
        request whose cut or plan fails leaves with its error, the others go on."""
        base = len(planned) + sum(len(s.run.prompt_ids) for s in joining)
        kept = allocate([offer for _, (offer, _) in planned], [cap for _, (_, cap) in planned], base, len(planned), self.cost,
                        max(self.max_rows, base))
        items: list[tuple[Submission, BatchItem]] = []
        for (submission, (offer, _)), keep in zip(planned, kept):
            run = submission.run
            plan = self._isolated(submission, lambda run=run, offer=offer, keep=keep: run.plan(run.take(offer, keep)))
            if plan is not None and run.seq is not None:
                items.append((submission, BatchItem(run.seq, plan[0], plan[1])))
        return items

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
        """Take a request out of the batch (its cache is freed with its run) and tell its owner."""
        if submission in self.running:
            self.running.remove(submission)
        submission.run.seq = None
        try:
            submission.on_end(reason)
        except Exception:  # noqa: BLE001 - one owner's failing callback must not stop the others' passes
            logger.exception("a request's end callback failed")
