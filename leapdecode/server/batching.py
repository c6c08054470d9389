"""Serving many requests at once: one thread runs the engine's scheduler, pass after pass.

Every request goes through it. Admitted requests do not wait for each other: each joins the
scheduler's shared passes at the next pass with room, and leaves when it ends, when its client
goes away (its rows and cache are freed at the next pass) or at its time limit. A model that
cannot share passes, `--max-batch 1`, or a method that runs the target's layers its own way runs
its requests in passes of their own, in the same scheduler. Each request's steps reach its route
through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from leapdecode.engine.backend import Backend, Packer
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.cost_measure import measure_batch_cost
from leapdecode.engine.cost_store import CurveKey, default_store
from leapdecode.engine.loop import Step
from leapdecode.engine.prefix_cache import PrefixCache
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import PassReport, Submission
from leapdecode.errors import InputError
from leapdecode.methods import backend_for
from leapdecode.methods.base import model_key
from leapdecode.models import LoadedModel
from leapdecode.server.config import ServerConfig
from leapdecode.server.jobs import Job
from leapdecode.server.memory import release_free_memory
from leapdecode.server.metrics import Metrics

logger = logging.getLogger("leapdecode")
MAX_DEFAULT_BATCH = 16  # the largest batch `default_max_batch` picks
PREFIX_CACHE_TOKENS = 8192  # the prefix cache's default size in tokens ...
PREFIX_CACHE_BYTES = 1 << 30  # ... unless fewer tokens' keys and values fill this
IDLE_S = 0.5  # after this long without work, the worker gives freed memory back to the system
GAIN = 1.2  # doubling the batch must raise the pass's rows per second by this much to be worth it


def default_max_batch(cost: ForwardCost) -> int:
    """The largest batch (1, 2, 4, .. MAX_DEFAULT_BATCH) at which doubling the rows of a pass still
    raised its rows per second by `GAIN` on the measured cost curve: past it, requests would share
    passes that cost nearly as much per row as passes of their own."""
    best = 1
    while best < MAX_DEFAULT_BATCH and (2 * best) / cost.of(2 * best) >= GAIN * best / cost.of(best):
        best *= 2
    return best


class Sink(Protocol):
    """Where a request's steps go (an asyncio queue, or one choice's tagged view of its request's)."""

    def put_nowait(self, item: Step | None | BaseException) -> None: ...


class BatchWorker:
    """The thread that runs `scheduler.step()` while there is work, and sleeps otherwise (giving
    the memory its requests freed back to the system once idle)."""

    def __init__(self, scheduler: BatchScheduler, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="leapdecode-batch", daemon=True)
        self._thread.start()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop, queue: Sink, on_done: Callable[[], None]) -> Submission:
        """Start `job` in the batch: its steps go to `queue`, then None (after its error, if it
        failed); `on_done` runs on the event loop once it has left the batch."""

        def on_step(step: Step) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, step)

        def on_end(reason: str) -> None:
            job.ended(reason, submission.cached_tokens)
            if submission.started_at is not None:
                self.metrics.queue_time.observe(submission.started_at - submission.submitted_at)
            if submission.error is not None:
                loop.call_soon_threadsafe(queue.put_nowait, submission.error)
            loop.call_soon_threadsafe(queue.put_nowait, None)
            loop.call_soon_threadsafe(on_done)

        run, backend = job.start()
        # bound before the scheduler's thread can end it (on_end reads it)
        submission = Submission(run, on_step, on_end, job.timeout_s, cancelled=job.cancel, backend=backend)
        return self.scheduler.submit(submission)

    def _loop(self) -> None:
        worked = False  # since memory was last given back
        while not self._stop.is_set():
            if not self.scheduler.wait_for_work(timeout=IDLE_S):
                if worked:  # idle for IDLE_S after work: give back what its requests freed
                    release_free_memory()
                    worked = False
                continue
            worked = True
            try:
                report = self.scheduler.step()
            except Exception as exc:  # noqa: BLE001 - end what is in the batch with the error; keep serving
                logger.exception("a shared pass failed")
                self.scheduler.fail_all(exc)
                continue
            if report is not None:
                self._observe(report)

    def _observe(self, report: PassReport) -> None:
        self.metrics.batch_sequences.observe(report.sequences)
        self.metrics.pass_rows.observe(report.rows)
        self.metrics.pass_seconds.observe(report.seconds)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def start_batching(lm: LoadedModel, config: ServerConfig, metrics: Metrics) -> BatchWorker:
    """The worker for `config.max_batch` (None: from the measured cost curve): shared passes where
    the model packs sequences and more than one request pays, else one request at a time."""
    backend: Backend = backend_for(lm)
    packer = backend.packer
    tokens = config.prefix_cache_tokens
    if tokens is None:
        tokens = default_prefix_cache_tokens(packer) if packer is not None else 0
    prefix_cache = PrefixCache(tokens) if tokens else None
    if config.max_batch == 1:
        return one_at_a_time(backend, metrics, "--max-batch 1", prefix_cache, config.max_pass_rows)
    reason = backend.batchable
    if reason is not None or packer is None:
        if config.max_batch is not None:
            raise InputError(f"--max-batch {config.max_batch}: {reason}")
        return one_at_a_time(backend, metrics, str(reason), prefix_cache, config.max_pass_rows)
    sequences = config.max_batch or 8  # the curve is by rows; eight sequences share them as a busy batch would
    cost = shared_pass_cost(lm, packer, config.max_pass_rows, sequences)
    max_batch = config.max_batch or min(default_max_batch(cost), config.max_pass_rows)
    if max_batch == 1:
        return one_at_a_time(
            backend,
            metrics,
            "shared passes cost as much per token as passes of their own here",
            prefix_cache,
            config.max_pass_rows,
        )
    scheduler = BatchScheduler(
        backend, cost, max_batch=max_batch, max_rows=config.max_pass_rows, prefix_cache=prefix_cache
    )
    logger.info(
        "serving up to %d requests in shared passes of up to %d tokens (%d while requests decode), %s",
        max_batch,
        config.max_pass_rows,
        scheduler.busy_rows,
        f"keeping up to {tokens} tokens of finished requests' caches for prompts that begin the same way"
        if prefix_cache is not None
        else "no prefix cache",
    )
    return BatchWorker(scheduler, metrics)


def shared_pass_cost(lm: LoadedModel, backend: Packer, rows: int, sequences: int) -> ForwardCost:
    """The cost of shared passes by their rows (1..`rows` over up to `sequences` requests):
    measured once per model on this machine, then read back (`engine.cost_store`)."""
    key = CurveKey(model_key(lm, backend), f"shared passes of {sequences} requests", torch.get_num_threads())
    cost, kept = default_store().curve(key, lambda: measure_shared_pass_cost(backend, rows, sequences), rows)
    if kept:
        logger.info("the cost of shared passes (1..%d tokens): as measured before on this machine", rows)
    return ForwardCost(cost.seconds[:rows], cost.spread)


def measure_shared_pass_cost(backend: Packer, rows: int, sequences: int) -> ForwardCost:
    logger.info("measuring the cost of shared passes (1..%d tokens over up to %d requests)", rows, sequences)
    return measure_batch_cost(backend, rows, sequences)


def default_prefix_cache_tokens(backend: Packer) -> int:
    """`PREFIX_CACHE_TOKENS`, or fewer where a token's keys and values are large (measured: one
    token prefilled): a 7B model without grouped-query attention keeps 0.5-1 MiB a token, so 8,192
    of them would take gigabytes a user never asked for."""
    seq, _ = backend.prefill([0])
    per_token = int(sum(layer.keys.nbytes + layer.values.nbytes for layer in seq.cache.layers))
    return max(1, min(PREFIX_CACHE_TOKENS, PREFIX_CACHE_BYTES // max(1, per_token)))


def one_at_a_time(
    backend: Backend, metrics: Metrics, why: str, prefix_cache: PrefixCache | None, rows: int
) -> BatchWorker:
    """A worker that runs one request at a time, each pass its own (with the prefix cache where
    the model is row-exact); on a backend that packs sequences, prompts go in chunks of `rows`,
    so that a long one steps aside for a shorter one waiting."""
    scheduler = BatchScheduler(backend, None, max_batch=1, max_rows=rows, prefix_cache=prefix_cache)
    logger.info(
        "serving one request at a time: %s; %s",
        why,
        "with a prefix cache" if scheduler.prefix_cache is not None else "no prefix cache",
    )
    return BatchWorker(scheduler, metrics)
