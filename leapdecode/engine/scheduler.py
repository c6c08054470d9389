"""Continuous batching: several requests decoded in shared target passes.

Requests join and leave between passes. Each pass packs, for every running request, its pending
token and the part of its draft that pays, plus chunks of the prompts of requests that joined
(their prefill rides along with the others' decoding in the rows the pass has left, Sarathi-style,
so a long prompt never stalls the others for more than one pass of `max_rows`, and those rows are
shared fairly among the prompts, so a short one is not held behind a long one's prefill; with no
slot free, a long prompt being prefilled steps aside for a shorter one waiting, keeping its chunks,
and takes the next slot that frees), into
one forward (`engine.batch`; the drafts planned and cut in `engine.pass_plan`); each request's
rows are bitwise what its own pass would give (a prompt's too, whatever its chunks), so its
output equals the request alone. Requests with the same prompt that join together (`n` > 1
siblings) share its prefill: one is prefilled, the others get copies of its cache. With a
prefix cache (`engine.prefix_cache`, on a row-exact model), a request that ends leaves its cache
there, and a request whose prompt begins with tokens a kept cache holds (a chat's history, a
system prompt) starts from a copy of it and prefills only the rest, in shared passes or in a
pass of its own.

Rows are shared, so drafts are cut for the whole pass, not per request: every drafted token comes
with its estimated probability of acceptance (its `reach`, from cost-aware drafting), and the pass
keeps the most probable tokens of all requests in the number that maximises the expected tokens
per second of the whole pass under the measured cost of a pass by rows (`engine.cost.allocate`,
the cut cost-aware drafting makes for one request, over all of them):

    (sequences decoding + prompt rows + sum of the kept tokens' reach) / cost(rows)

On a CPU a row is dear once a pass holds a few: with eight requests, a drafted token must be
likelier than about (8 x the cost of one more row / the cost of the pass) to earn its row, so
speculation falls back to plain decoding rows when they are dear and drafts again as the batch
thins. One pass is `step()`; the server's worker thread and the benchmark call it in a loop.

It is the only driver: a request alone is a batch of one (`engine.alone`), and a request that cannot
share passes (a backend that cannot pack sequences: llama.cpp, a method that runs the target's
layers its own way) runs in passes of its own, taking turns with the shared pass. Such a pass is
the same pass with one member (`_pass`) on the request's own backend, its offer cut by the curve
its drafter priced it with; only its prompt goes in whole, through its backend's own prefill
(llama.cpp and the layered backends take no prompt chunks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.cost import efficient_rows
from leapdecode.engine.drafting import PassCost
from leapdecode.engine.loop import Step
from leapdecode.engine.pass_plan import cut_drafts, features_for, plan_offers
from leapdecode.engine.prefills import hand_over, leader_of, prompt_chunks
from leapdecode.engine.prefix_cache import PrefixCache
from leapdecode.engine.prefix_reuse import PrefixReuse
from leapdecode.engine.submission import PassReport, Prefill, Submission
from leapdecode.errors import InputError
from leapdecode.models.row_exact import PASS_ROWS

logger = logging.getLogger("leapdecode")
T = TypeVar("T")
WAIT_TOKENS = 16  # a joining request waits for a prompt being prefilled that will give it this many more tokens

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, CacheState, Packer, Scores


class BatchScheduler:
    """Runs submitted requests in shared passes on one backend that packs them (`Packer`), or one request at a time in
    passes of its own on any `Backend` (see the module doc)."""

    def __init__(
        self,
        backend: Backend,
        cost: PassCost | None,
        *,
        max_batch: int = 8,
        max_rows: int = 128,
        clock: Callable[[], float] = time.monotonic,
        prefix_cache: PrefixCache | None = None,
        wait_tokens: int = WAIT_TOKENS,
    ) -> None:
        """`cost`: the measured cost of a shared pass by rows on `backend`, which must pack
        sequences; None: no shared curve, each pass cut by its request's own (any backend; on
        one that packs sequences, with `max_rows` past 1, requests still take their prompts in
        chunks, so that a long prefill can step aside). `prefix_cache`: where requests
        on `backend`'s model leave their caches and start from kept prefixes, where that model is
        row-exact (`Backend.batchable` None), and start from running requests' caches too
        (waiting for a prompt being prefilled that will give `wait_tokens` more); None: each prompt
        is prefilled whole."""
        if cost is not None and backend.batchable is not None:
            raise InputError(backend.batchable)
        if wait_tokens < 1:
            raise InputError(f"wait_tokens must be at least 1, got {wait_tokens}")
        if not 1 <= max_batch <= max_rows <= PASS_ROWS:
            raise InputError(
                f"max_batch must be at least 1, and max_rows from max_batch to {PASS_ROWS}; got {max_batch} and "
                f"{max_rows}"
            )
        self.backend = backend
        self.cost = cost
        # requests on a backend that packs sequences share passes on it; the others run alone
        self.packing = backend.packer if cost is not None or max_rows > 1 else None
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.clock = clock
        # while requests decode, a pass holds no more rows than this (prompt chunks shrink): past
        # it prompt rows cost as much each, and the decoding requests would wait longer per token
        self.busy_rows = efficient_rows(cost, max_rows) if cost is not None else max_rows
        # the model whose requests keep and take prefixes: one whose every row is bitwise its own pass
        self.reusing = backend.packer if backend.batchable is None else None
        self.prefix_cache = prefix_cache if self.reusing is not None else None
        self.reuse = PrefixReuse(self.prefix_cache, wait_tokens) if self.prefix_cache is not None else None
        self.waiting: deque[Submission] = deque()
        self.running: list[Submission] = []  # admitted: decoding, prefilling, or following a prefill
        self.prefilling: dict[Submission, Prefill] = {}  # in order of admission
        self.stepped_aside: dict[Submission, Prefill] = {}  # prefills waiting (in `waiting`) to go on
        self._turn = 0  # whose pass is next: the shared pass, then each request alone in turn
        self._lock = threading.Lock()
        self.wake = threading.Condition(self._lock)  # notified on submit: an idle worker sleeps on it

    @classmethod
    def alone(cls, backend: Backend, prefix_cache: PrefixCache | None = None) -> BatchScheduler:
        """A batch of one: one request at a time, each pass the decode loop's step for it."""
        return cls(backend, None, max_batch=1, max_rows=1, prefix_cache=prefix_cache)

    def submit(self, submission: Submission) -> Submission:
        """Queue a request (any thread); it joins at a pass with room for it."""
        if not submission.run.prompt_ids:
            raise InputError("a request needs at least one prompt token")
        backend = submission.backend if submission.backend is not None else self.backend
        # it shares passes only over the same model, on a backend that packs sequences
        packer = backend.packer
        same_model = packer is not None and self.packing is not None and packer.model is self.packing.model
        submission.alone = not same_model or backend.batchable is not None
        # its cache is bitwise what a prefill of its tokens gives: it may start from a kept prefix and leave one
        submission.keeps_prefix = (
            self.prefix_cache is not None
            and self.reusing is not None
            and packer is not None
            and packer.model is self.reusing.model
            and backend.batchable is None
            and not submission.run.features  # a drafter that reads the target's states needs the whole prompt's
        )
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
        """One pass: the shared pass over the requests that share (their decoding rows, then
        prompt chunks in the rows left, shared fairly: `share_rows`), or one request's pass of
        its own, in turn; None when there is nothing to do."""
        self._drop_leavers()
        self._admit()
        for ready in self.reuse.ready(self.prefilling) if self.reuse is not None else ():
            self._isolated(ready, functools.partial(self._join_prefill, ready))
        decoding = [s for s in self.running if not s.alone and s.run.seq is not None]
        turns: list[Submission | None] = [None] if decoding or self.prefilling else []
        turns += [s for s in self.running if s.alone]
        if not turns:
            return None
        turn = turns[self._turn % len(turns)]
        self._turn += 1
        start = self.clock()
        report: PassReport | None
        if turn is not None:
            report = self._alone_pass(turn)
        else:
            rows = self.max_rows - len(decoding)  # for prompt chunks
            if decoding:  # a pass no bigger than pays per row: the decoding requests wait less per token
                rows = min(rows, max(1, self.busy_rows - len(decoding)))
            report = self._pass(decoding, prompt_chunks(self.prefilling, rows), self._packer())
        return dataclasses.replace(report, seconds=self.clock() - start) if report is not None else None

    def _alone_pass(self, submission: Submission) -> PassReport | None:
        """One pass of a request that does not share, on its own backend: its prompt, or the
        shared pass's steps with it the only member."""
        run = submission.run
        backend = submission.backend if submission.backend is not None else self.backend
        if run.seq is not None:
            return self._pass([submission], [], backend)

        # 1. Prefill: the prompt's pass also gives the first new token.
        def prefill() -> int:
            seq, scores = self._prefill_alone(submission, backend)
            submission.decoding_at = self.clock()
            return self._deliver(submission, run.begin(backend, seq, scores))  # 2. emit

        emitted = self._isolated(submission, prefill) or 0
        rows = len(run.prompt_ids) - submission.cached_tokens
        return PassReport(1, rows, rows, 0, emitted, 0.0)

    def _prefill_alone(self, submission: Submission, backend: Backend) -> tuple[CacheState, Scores]:
        """A request's prompt in a pass of its own: from a copy of its longest kept prefix where
        there is one, else whole."""
        run = submission.run
        packer = backend.packer
        if packer is not None and self.reuse is not None and submission.keeps_prefix:
            taken = self.reuse.kept_prefix(submission, packer.fork)
            if taken is not None:
                return packer.prefill(run.prompt_ids, cached=taken)
        return backend.prefill(run.prompt_ids, features=run.features)

    def _packer(self) -> Packer:
        """The backend of the shared passes (only requests that share reach them)."""
        assert self.packing is not None, "a shared pass on a scheduler that does not share"
        return self.packing

    def fail_all(self, error: BaseException) -> None:
        """End every running and waiting request with `error` (the caller's loop failed)."""
        with self._lock:
            waiting = list(self.waiting)
            self.waiting.clear()
        self.prefilling.clear()  # (a request waiting on a prefill stops waiting as it ends)
        self.stepped_aside.clear()
        for submission in [*self.running, *waiting]:
            submission.error = error
            self._end(submission, "error")

    def _pass(
        self, decoding: list[Submission], chunks: list[tuple[Submission, BatchItem]], backend: Backend
    ) -> PassReport | None:
        """Plan, score and settle one pass on `backend`: the shared pass (the packer), or a pass
        of one request's own (one member, no chunks). The loop's steps, for every member:
        3. offer a draft; 4. cut the offers to what the pass's cost says pays; 5. score every
        member's pending token and kept draft, and the prompt chunks, in one forward; 6-8. verify,
        keep the accepted path in the cache, the drafter hears the pass, emit (`SequenceRun.settle`).
        A request whose drafting, verifying or callbacks fail leaves with its error, the others go
        on (a failed forward ends them all)."""
        shared = backend is self.packing
        cost = self.cost if shared else None
        batch = sum(not s.alone for s in self.running) if shared else 1
        planned = plan_offers(decoding, backend, batch, cost, self._isolated)  # 3.
        prefill = sum(len(item.tokens) for _, item in chunks)
        drafting = cut_drafts(
            planned, len(planned) + prefill, cost, self.max_rows if shared else None, self._isolated
        )  # 4.
        members = [s for s, _ in drafting] + [s for s, _ in chunks]
        items = [item for _, item in drafting] + [item for _, item in chunks]
        if not items:
            return None
        wanted = tuple(sorted({layer for s in members for layer in s.run.features}))
        try:
            scores = self._score(backend, items, wanted)  # 5.
        except Exception as exc:  # noqa: BLE001 - the pass failed: each of its requests ends with the error
            followers = [
                f for s, _ in chunks for f in self.prefilling.pop(s).followers
            ]  # their prompt's cache is spoiled
            for submission in members + followers:
                submission.error = exc
                self._end(submission, "error")
            return None
        emitted = 0
        for (submission, _), score in zip(drafting, scores):
            settle = functools.partial(self._settled, submission, backend, score, wanted)
            emitted += self._isolated(submission, settle) or 0  # 6-8.
        for (submission, item), score in zip(chunks, scores[len(drafting) :]):
            try:
                emitted += self._prefilled(submission, len(item.tokens), features_for(submission.run, score, wanted))
            except Exception as exc:  # noqa: BLE001 - this prompt's requests end with the error, the others go on
                spoiled = self.prefilling.pop(submission, None)
                for member in [submission, *(spoiled.followers if spoiled is not None else ())]:
                    member.error = exc
                    self._end(member, "error")
        rows = sum(len(item.tokens) for item in items)
        return PassReport(len(items), rows, prefill, rows - prefill - len(drafting), emitted, 0.0)

    def _score(self, backend: Backend, items: list[BatchItem], wanted: tuple[int, ...]) -> list[Scores]:
        """One forward over the pass's items: packed on the shared pass's backend, else the one
        member's own forward."""
        if backend is self.packing:
            return forward_batch(self.packing, items, wanted)
        (item,) = items
        return [backend.forward(item.seq, list(item.tokens), tree=item.tree, features=wanted)]

    def _settled(self, submission: Submission, backend: Backend, scores: Scores, wanted: tuple[int, ...]) -> int:
        """A decoding request's rows were scored: verify, keep, emit."""
        return self._deliver(submission, submission.run.settle(backend, features_for(submission.run, scores, wanted)))

    def _prefilled(self, submission: Submission, rows: int, scores: Scores) -> int:
        """A chunk of `submission`'s prompt was scored; once the whole prompt is in, it and the
        requests following its prefill (each with a copy of the cache) begin decoding."""
        from leapdecode.engine.backend import Scores

        prefill = self.prefilling[submission]
        prefill.done += rows
        if scores.features is not None:
            prefill.features.append(scores.features)  # [rows, F]
        if prefill.done < len(submission.run.prompt_ids):
            return 0
        whole = Scores(
            scores.logits, features=torch.cat(prefill.features) if prefill.features else None
        )  # features [prompt, F]
        del self.prefilling[submission]  # below, each request's failure is its own
        now = self.clock()
        for member in (submission, *prefill.followers):
            member.decoding_at = now
        forks = [(f, self._isolated(f, functools.partial(self._packer().fork, prefill.seq))) for f in prefill.followers]
        emitted = self._isolated(submission, functools.partial(self._begin, submission, prefill.seq, whole)) or 0
        for follower, seq in forks:
            if seq is not None:
                emitted += self._isolated(follower, functools.partial(self._begin, follower, seq, whole)) or 0
        return emitted

    def _begin(self, submission: Submission, seq: CacheState, scores: Scores) -> int:
        """A request's prompt is in `seq`: its first token."""
        return self._deliver(submission, submission.run.begin(self._packer(), seq, scores))

    def _deliver(self, submission: Submission, step: Step) -> int:
        submission.on_step(step)
        if submission.run.done:
            self._end(submission, step.finish_reason or "length")
        return len(step.tokens)

    def _isolated(self, submission: Submission, work: Callable[[], T]) -> T | None:
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
            elif submission.overdue(now):
                self._end(submission, "timeout")

    def _admit(self) -> None:
        """Waiting requests join, oldest first, while the batch has room, each to its prefill
        (`_join_prefill`), or back to the prefill it stepped aside from. With no room, a long
        prompt being prefilled steps aside for a shorter one waiting (`_steps_aside`)."""
        with self._lock:
            joining = []
            while self.waiting and len(self.running) < self.max_batch:
                joining.append(self._join_batch(self.waiting.popleft()))
            aside = self._steps_aside()
            if aside is not None:
                self.running.remove(aside)
                self.stepped_aside[aside] = self.prefilling.pop(aside)
                joining.append(self._join_batch(self.waiting.popleft()))
                self.waiting.appendleft(aside)  # it takes the next slot that frees, before any other
        for submission in joining:
            resumed = self.stepped_aside.pop(submission, None)
            if resumed is not None:  # its chunks so far are in its cache: it goes on from them
                self.prefilling[submission] = resumed
            elif not submission.alone:  # else prefilled in a pass of its own
                self._isolated(submission, functools.partial(self._join_prefill, submission))

    def _join_batch(self, submission: Submission) -> Submission:
        submission.started_at = self.clock()
        self.running.append(submission)
        return submission

    def _steps_aside(self) -> Submission | None:
        """The prompt being prefilled that gives its batch slot to the first waiting request, so
        that a short request is not held behind a long prompt's whole prefill whatever
        `max_batch` is: the latest admitted whose prompt has more than a full pass of rows and
        more than the waiting prompt's length left, that no other request follows or waits on.
        None while the batch has room, or when the first waiting request stepped aside itself."""
        if not self.waiting or len(self.running) < self.max_batch or self.waiting[0] in self.stepped_aside:
            return None
        wanted = len(self.waiting[0].run.prompt_ids)
        awaited = {leader for leader, _ in self.reuse.awaiting.values()} if self.reuse is not None else set()
        for submission, prefill in reversed(self.prefilling.items()):
            left = len(submission.run.prompt_ids) - prefill.done
            if left > max(wanted, self.max_rows) and not prefill.followers and submission not in awaited:
                return submission
        return None

    def _join_prefill(self, submission: Submission) -> None:
        """A joining request's prefill: following a prefill of the same prompt (same states
        wanted) to share it; else from a copy of the longest prefix of its prompt that a kept or a
        running request's cache holds, after waiting for a prompt being prefilled to hold more
        (`engine.prefix_reuse`), or from an empty cache."""
        run = submission.run
        leader = leader_of(self.prefilling, run)
        if leader is not None:
            self.prefilling[leader].followers.append(submission)
            submission.cached_tokens = leader.cached_tokens
            return
        prefill = None
        if self.reuse is not None and submission.keeps_prefix:
            prefill = self.reuse.start(submission, self.running, self.prefilling, self._packer().fork)
            if submission in self.reuse.awaiting:
                return
        self.prefilling[submission] = prefill if prefill is not None else Prefill(self._packer().new_sequence())

    def _end(self, submission: Submission, reason: str) -> None:
        """Take a request out of the batch and tell its owner. Its cache is freed with its run,
        or kept by the prefix cache (`PrefixReuse.leave`: a finished request's, or the chunks of
        a prompt it leaves part-prefilled)."""
        if submission in self.running:
            self.running.remove(submission)
        self.prefilling, orphan = hand_over(self.prefilling, submission)
        orphan = self.stepped_aside.pop(submission, orphan)
        if self.reuse is not None:
            self.reuse.leave(submission, reason, orphan)
        submission.run.seq = None
        try:
            submission.on_end(reason)
        except Exception:  # noqa: BLE001 - one owner's failing callback must not stop the others' passes
            logger.exception("a request's end callback failed")
