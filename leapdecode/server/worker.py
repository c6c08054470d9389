"""The model's side of the server: requests are admitted up to a bound, decoded together in
shared passes (`server.batching`) or one at a time on one worker thread, and a request whose
client left stops at its next step.

At most `max_queue` requests are admitted at once (running plus waiting), and beyond that a
request gets 429 at once, never a hang. Each request has a time limit. A method that runs the
target's layers its own way (self-speculation, early exit) cannot share passes and runs on the
one-at-a-time worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.requests import Request

from leapdecode.api import Decoder
from leapdecode.engine import Step
from leapdecode.engine.loop import SequenceRun
from leapdecode.engine.cost import ForwardCost, measure_forward_cost
from leapdecode.errors import MethodError
from leapdecode.methods import Method, backend_for, parse_method
from leapdecode.models import LoadedModel
from leapdecode.server.batching import BatchWorker, start_batching
from leapdecode.server.config import ServerConfig
from leapdecode.server.errors import ApiError, generation_failure, timeout_error
from leapdecode.server.metrics import Metrics
from leapdecode.server.openai_format import SSE_DONE, StreamText, finish_reason, sse, usage

logger = logging.getLogger("leapdecode")
COST_TOKENS = 17  # forward cost measured at start for 1..17 tokens; longer drafts extrapolate its slope
MAX_DECODERS = 32  # decoders kept for per-request methods; beyond, all but the served one are dropped


@dataclass
class Job:
    """One admitted request's generation, run on the worker thread.

    Everything slow happens there, inside the request's time limit, which starts when the
    worker takes the job (waiting in the queue does not count): building the method's decoder
    (cached per canonical method string) and decoding."""

    method: Method
    decoder_for: Callable[[Method], Decoder]
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    temperature: float
    top_p: float
    seed: int | None
    timeout_s: float
    logprobs: int | None = None  # alternatives per token to report; None: no log-probabilities
    cancel: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = "length"
    timed_out: bool = False
    method_name: str = ""

    def batchable(self) -> bool:
        """Whether this job's method can share passes with others (its backend is the model's
        own, row-exact); one that runs the target's layers its own way (self-speculation, early
        exit) runs on the one-at-a-time worker instead."""
        return getattr(self.decoder_for(self.method).backend, "batchable", "not a torch backend") is None

    def start(self) -> SequenceRun:
        """The generation as a run for the batch scheduler (`server.batching`); raises on bad input."""
        decoder = self.decoder_for(self.method)
        self.method_name = str(decoder.method)
        return decoder.start(
            self.prompt_ids, max_new_tokens=self.max_tokens, stop=self.stop,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, logprobs=self.logprobs,
        )

    def steps(self) -> Iterator[Step]:
        """The decode loop's steps, stopping early on cancel (client gone) or the deadline."""
        if self.cancel.is_set():  # the client left while the request waited: no prefill
            self.finish_reason = "cancelled"
            return
        deadline = time.monotonic() + self.timeout_s
        decoder = self.decoder_for(self.method)
        self.method_name = str(decoder.method)
        stream = decoder.stream(
            self.prompt_ids, max_new_tokens=self.max_tokens, stop=self.stop,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, logprobs=self.logprobs,
        )
        try:
            for step in stream:
                if self.cancel.is_set():
                    self.finish_reason = "cancelled"
                    return
                yield step
                if step.finish_reason:
                    self.finish_reason = step.finish_reason
                    return
                if time.monotonic() > deadline:
                    self.timed_out = True
                    return
        finally:
            stream.close()


@dataclass
class ServerState:
    """What every route shares: the model, its decoders (by canonical method string; built on the
    worker thread, or on the event loop where requests share passes), the one-at-a-time worker
    thread, the batch worker, and the count of admitted requests (touched on the event loop's
    thread only)."""

    lm: LoadedModel
    config: ServerConfig
    metrics: Metrics
    served: Method
    allowed: tuple[str, ...]  # method names a request may choose
    costs: dict[bool, ForwardCost]  # by "drafts a tree"
    executor: ThreadPoolExecutor
    default_decoder: Decoder
    decoders: dict[str, Decoder] = field(default_factory=dict)
    batch: BatchWorker | None = None  # shared passes (`--max-batch` above 1); None: one request at a time
    decoders_lock: threading.Lock = field(default_factory=threading.Lock)
    admitted: int = 0  # running + waiting
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def start(cls, lm: LoadedModel, config: ServerConfig, metrics: Metrics, served: Method, allowed: tuple[str, ...]) -> ServerState:
        """Measure the forward cost once per model, here (no request measures it, on the event loop
        or while another request decodes), and build the served method's decoder (a draft model,
        if any, loads once, at start)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leapdecode-decode")
        logger.info("measuring the forward cost of 1..%d tokens (chains and trees)", COST_TOKENS)
        costs = {tree: measure_forward_cost(backend_for(lm), COST_TOKENS, tree=tree) for tree in (False, True)}
        default_decoder = Decoder(lm, served, cost=costs[served.drafts == "tree"])
        batch = start_batching(lm, config, metrics)
        state = cls(lm, config, metrics, served, allowed, costs, executor, default_decoder, batch=batch)
        state.decoders[state.default_key] = default_decoder
        return state

    @property
    def default_key(self) -> str:
        return str(self.default_decoder.method)

    def choose_method(self, method: str | None) -> Method:
        """Parse and check a request's method on the event loop (cheap); built later, in the worker."""
        parsed = parse_method(method) if method else self.served
        if str(parsed) == self.default_key:
            return parsed
        if parsed.loads_files:
            # a client must not make the server load models or read paths it names
            raise MethodError(f"{str(parsed)!r} loads files (a draft model or a datastore): choose it when the server starts (--method)")
        if parsed.name not in self.allowed:
            raise ApiError(400, f"method {parsed.name!r} is not allowed on this server; allowed: {', '.join(self.allowed)}",
                           code="method_not_allowed", param="leapdecode.method")
        return parsed

    def decoder_for(self, method: Method) -> Decoder:
        key = str(method)  # "ANPD:k=7 " and "anpd:n=5,k=7" share one decoder
        with self.decoders_lock:  # the event loop (shared passes) and the worker thread both build them
            if key not in self.decoders:
                if len(self.decoders) >= MAX_DECODERS:
                    self.decoders.clear()
                    self.decoders[self.default_key] = self.default_decoder
                self.decoders[key] = Decoder(self.lm, method, cost=self.costs[method.drafts == "tree"])
            return self.decoders[key]

    def admit(self) -> None:
        if self.admitted >= self.config.max_queue:
            raise ApiError(429, f"The server is busy: {self.admitted} requests are admitted (limit {self.config.max_queue}). Retry later.",
                           type_="rate_limit_error", code="queue_full")
        self.admitted += 1
        self.metrics.queue_depth.set(self.admitted - 1)

    def release(self) -> None:
        self.admitted -= 1
        self.metrics.queue_depth.set(max(0, self.admitted - 1))

    def _run_blocking(self, job: Job) -> list[Step]:
        with self.metrics.running.track_inprogress():
            return list(job.steps())

    async def complete(self, job: Job, endpoint: str, request: Request) -> list[Step]:
        """Run a non-streaming request and count it; a client that goes away cancels its
        generation at the next step (or before it starts)."""
        batched = self.batch is not None and job.batchable()  # builds the method's decoder: may refuse it, before admission
        self.admit()
        start = time.perf_counter()
        if batched:
            steps = await self._complete_batched(job, request)
        else:
            try:
                future = asyncio.get_running_loop().run_in_executor(self.executor, self._run_blocking, job)
                while True:
                    done, _ = await asyncio.wait({future}, timeout=0.25)
                    if done:
                        break
                    if await request.is_disconnected():
                        job.cancel.set()
                steps = future.result()
            finally:
                self.release()
        if job.finish_reason == "cancelled":  # counted in /metrics by the ApiError handler, as every error is
            raise ApiError(499, "The client closed the request.", code="client_closed_request")
        if job.timed_out:
            raise timeout_error(self.config.timeout_s)
        self.metrics.record(len(job.prompt_ids), steps)
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return steps

    async def _complete_batched(self, job: Job, request: Request) -> list[Step]:
        """A non-streaming request in the shared passes: its steps until it leaves the batch."""
        queue: asyncio.Queue[Step | None | BaseException] = asyncio.Queue()
        self._submit(job, queue)
        steps: list[Step] = []
        checked = time.monotonic()
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=0.25)
                except TimeoutError:
                    item = ...
                if time.monotonic() - checked >= 0.25:  # however fast steps arrive
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        job.cancel.set()  # leaves at the next pass
                if item is ...:
                    continue
                if item is None:
                    finished = True
                    return steps
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                steps.append(item)
        finally:
            if not finished:  # cancelled here (the server stopping): leave the batch too
                job.cancel.set()

    def _submit(self, job: Job, queue: asyncio.Queue[Step | None | BaseException]) -> None:
        """Hand an admitted job to the batch; it is released when it leaves (or now, if refused)."""
        assert self.batch is not None
        try:
            self.batch.submit(job, asyncio.get_running_loop(), queue, self.release)
        except BaseException:
            self.release()
            raise

    def stream(self, job: Job, text: StreamText, include_usage: bool, endpoint: str) -> AsyncIterator[str]:
        """Admit `job` now (429 before any byte is sent), start it on the worker thread (or in the
        shared passes), and return its SSE lines; a client that goes away stops it at the next step."""
        batched = self.batch is not None and job.batchable()  # may refuse the method, before admission
        self.admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Step | None | BaseException] = asyncio.Queue()
        if batched:
            self._submit(job, queue)
            return self._events(job, queue, text, include_usage, endpoint, time.perf_counter())

        def work() -> None:
            try:
                with self.metrics.running.track_inprogress():
                    for step in job.steps():
                        loop.call_soon_threadsafe(queue.put_nowait, step)
            except BaseException as exc:  # hand any failure to the event loop, which reports it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        future = loop.run_in_executor(self.executor, work)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self.release))
        return self._events(job, queue, text, include_usage, endpoint, time.perf_counter())

    async def _events(
        self, job: Job, queue: asyncio.Queue[Step | None | BaseException], text: StreamText, include_usage: bool,
        endpoint: str, start: float,
    ) -> AsyncIterator[str]:
        """The SSE lines of a streamed request as its steps arrive, counted in /metrics once."""
        steps: list[Step] = []
        status = "200"
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    error = generation_failure(item)
                    status = str(error.status)
                    yield sse(error.body())
                    yield SSE_DONE
                    return
                if not steps:
                    self.metrics.first_token.observe(time.perf_counter() - start)
                steps.append(item)
                line = text.step(item)
                if line:
                    yield line
            if job.timed_out:
                status = "503"
                yield sse(timeout_error(self.config.timeout_s).body())
            else:
                for line in text.end(finish_reason(job.finish_reason), usage(len(job.prompt_ids), steps) if include_usage else None):
                    yield line
            yield SSE_DONE
            self.metrics.record(len(job.prompt_ids), steps)
        except (asyncio.CancelledError, GeneratorExit):
            status = "499"  # the client went away: stop decoding at the next step
            job.cancel.set()
            raise
        finally:
            job.cancel.set()
            self.metrics.requests.labels(endpoint, status).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
