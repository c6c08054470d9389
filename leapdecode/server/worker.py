"""The model's side of the server: requests are admitted up to a bound, decoded together in
shared passes (`server.batching`) or one at a time on one worker thread, and a request whose
client left stops at its next step.

At most `max_queue` generations are admitted at once (running plus waiting; a request with `n`
choices counts `n`), and beyond that a request gets 429 at once, never a hang. Each request has a time limit. A method that runs the
target's layers its own way (self-speculation, early exit) cannot share passes and runs on the
one-at-a-time worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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
from leapdecode.server.batching import BatchWorker, Sink, start_batching
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

    Everything slow happens there: building the method's decoder (cached per canonical method
    string) and the prefill, within a time limit of their own from when the worker takes the job
    (waiting in the queue does not count), then decoding, within its time limit from the first
    token, as in the shared passes (`Submission.overdue`)."""

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

    @property
    def ended_early(self) -> bool:
        """Cancelled (client gone) or past its time limit: its siblings need not run."""
        return self.timed_out or self.finish_reason == "cancelled" or self.cancel.is_set()

    def siblings(self, n: int) -> list[Job]:
        """This job as `n` choices sharing one cancel: choice i samples with seed + i (choice 0
        is the n=1 response; without a seed each draws its own), greedy choices are equal."""
        seeds = [None if self.seed is None else (self.seed + i + 2**63) % 2**64 - 2**63 for i in range(n)]  # wrapped to int64
        return [self if i == 0 else dataclasses.replace(self, seed=seed) for i, seed in enumerate(seeds)]

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
        deadline = time.monotonic() + self.timeout_s  # the decoder and the prefill; then decoding from the first token
        first = True
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
                if first:
                    deadline, first = time.monotonic() + self.timeout_s, False
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
    on_worker: int = 0  # generations decoding on the one-at-a-time worker now (0 or 1; written on its thread)
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
        metrics.running.set_function(state.running)
        metrics.queue_depth.set_function(lambda: max(0, state.admitted - state.running()))
        return state

    def running(self) -> int:
        """Generations decoding: in the batch (prefilling or decoding) or on the worker thread."""
        return (len(self.batch.scheduler.running) if self.batch is not None else 0) + self.on_worker

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

    def admit(self, count: int = 1) -> None:
        """Admit `count` generations (a request's choices) or refuse them all (429)."""
        if self.admitted + count > self.config.max_queue:
            raise ApiError(429, f"The server is busy: {self.admitted} requests are admitted (limit {self.config.max_queue}). Retry later.",
                           type_="rate_limit_error", code="queue_full")
        self.admitted += count

    def release(self, count: int = 1) -> None:
        self.admitted -= count

    def _run_blocking(self, jobs: list[Job]) -> list[list[Step]]:
        """A request's choices one after another, each within its own time limit; a choice that
        ends early (timeout, client gone) ends the request."""
        choices: list[list[Step]] = []
        for job in jobs:
            choices.append(list(self._on_worker(job)))
            if job.ended_early:
                break
        return choices

    def _on_worker(self, job: Job) -> Iterator[Step]:
        """`job`'s steps on the worker thread, counted as running while it decodes."""
        self.on_worker += 1
        try:
            yield from job.steps()
        finally:
            self.on_worker -= 1

    async def complete(self, jobs: list[Job], endpoint: str, request: Request) -> list[list[Step]]:
        """Run a non-streaming request's choices (siblings sharing one cancel) and count them; a
        client that goes away cancels their generation at the next step (or before it starts)."""
        batched = self.batch is not None and jobs[0].batchable()  # builds the method's decoder: may refuse it, before admission
        self.admit(len(jobs))
        start = time.perf_counter()
        if batched:
            queues: list[asyncio.Queue[Step | None | BaseException]] = [asyncio.Queue() for _ in jobs]
            self._submit_all(jobs, queues)
            ended = await asyncio.gather(*(self._choice_batched(job, queue, request) for job, queue in zip(jobs, queues)),
                                         return_exceptions=True)
            failed = [e for e in ended if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
            steps = [e for e in ended if not isinstance(e, BaseException)]
        else:
            try:
                future = asyncio.get_running_loop().run_in_executor(self.executor, self._run_blocking, jobs)
                while True:
                    done, _ = await asyncio.wait({future}, timeout=0.25)
                    if done:
                        break
                    if await request.is_disconnected():
                        jobs[0].cancel.set()
                steps = future.result()
            finally:
                self.release(len(jobs))
        if any(job.timed_out for job in jobs):  # (its siblings then leave as cancelled)
            raise timeout_error(self.config.timeout_s)
        if any(job.finish_reason == "cancelled" for job in jobs) or len(steps) < len(jobs):  # counted in /metrics by the ApiError handler
            raise ApiError(499, "The client closed the request.", code="client_closed_request")
        for i, choice in enumerate(steps):
            self.metrics.record(len(jobs[0].prompt_ids) if i == 0 else 0, choice)  # the prompt once
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return steps

    async def _choice_batched(self, job: Job, queue: asyncio.Queue[Step | None | BaseException], request: Request) -> list[Step]:
        """One choice in the shared passes; one that fails or times out ends its siblings too."""
        try:
            steps = await self._complete_batched(job, queue, request)
        except BaseException:
            job.cancel.set()  # shared by the siblings: they leave at the next pass
            raise
        if job.timed_out:
            job.cancel.set()
        return steps

    async def _complete_batched(self, job: Job, queue: asyncio.Queue[Step | None | BaseException], request: Request) -> list[Step]:
        """A non-streaming choice in the shared passes: its steps until it leaves the batch."""
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

    def _submit_all(self, jobs: list[Job], sinks: Sequence[Sink]) -> None:
        """Hand a request's admitted choices to the batch; each is released when it leaves. If
        one is refused, the rest are released now and those already in the batch leave."""
        assert self.batch is not None
        for submitted, (job, sink) in enumerate(zip(jobs, sinks)):
            try:
                self.batch.submit(job, asyncio.get_running_loop(), sink, self.release)
            except BaseException:
                self.release(len(jobs) - submitted)
                job.cancel.set()  # shared by the siblings
                raise

    def stream(self, jobs: list[Job], texts: list[StreamText], include_usage: bool, endpoint: str) -> AsyncIterator[str]:
        """Admit a request's choices now (429 before any byte is sent), start them on the worker
        thread (one after another) or in the shared passes (together), and return their SSE
        lines; a client that goes away stops them at the next step."""
        batched = self.batch is not None and jobs[0].batchable()  # may refuse the method, before admission
        self.admit(len(jobs))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Step | None | BaseException]] = asyncio.Queue()
        if batched:
            self._submit_all(jobs, [ChoiceSink(queue, i) for i in range(len(jobs))])
            return self._events(jobs, queue, texts, include_usage, endpoint, time.perf_counter())

        def work() -> None:
            index = 0
            try:
                for index, job in enumerate(jobs):
                    for step in self._on_worker(job):
                        loop.call_soon_threadsafe(queue.put_nowait, (index, step))
                    loop.call_soon_threadsafe(queue.put_nowait, (index, None))
                    if job.ended_early:  # the stream ends with it: the other choices do not run
                        return
            except BaseException as exc:  # hand any failure to the event loop, which reports it
                loop.call_soon_threadsafe(queue.put_nowait, (index, exc))

        future = loop.run_in_executor(self.executor, work)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self.release, len(jobs)))
        return self._events(jobs, queue, texts, include_usage, endpoint, time.perf_counter())

    async def _events(
        self, jobs: list[Job], queue: asyncio.Queue[tuple[int, Step | None | BaseException]], texts: list[StreamText],
        include_usage: bool, endpoint: str, start: float,
    ) -> AsyncIterator[str]:
        """The SSE lines of a streamed request's choices as their steps arrive (each choice's
        chunks carry its index), counted in /metrics once."""
        steps: list[list[Step]] = [[] for _ in jobs]
        status = "200"
        running = len(jobs)
        try:
            while running:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    error = generation_failure(item)
                    status = str(error.status)
                    yield sse(error.body())
                    yield SSE_DONE
                    return
                if item is None:  # this choice ended
                    running -= 1
                    if jobs[index].timed_out:
                        status = "503"
                        yield sse(timeout_error(self.config.timeout_s).body())
                        yield SSE_DONE
                        return
                    for line in texts[index].end(finish_reason(jobs[index].finish_reason)):
                        yield line
                    continue
                if not any(steps):
                    self.metrics.first_token.observe(time.perf_counter() - start)
                steps[index].append(item)
                line = texts[index].step(item)
                if line:
                    yield line
            if include_usage:
                yield texts[0].usage_line(usage(len(jobs[0].prompt_ids), [s for choice in steps for s in choice]))
            yield SSE_DONE
            for i, choice in enumerate(steps):
                self.metrics.record(len(jobs[0].prompt_ids) if i == 0 else 0, choice)  # the prompt once
        except (asyncio.CancelledError, GeneratorExit):
            status = "499"  # the client went away: stop decoding at the next step
            jobs[0].cancel.set()  # shared by the siblings
            raise
        finally:
            jobs[0].cancel.set()
            self.metrics.requests.labels(endpoint, status).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


@dataclass(frozen=True)
class ChoiceSink:
    """Where the batch worker puts one choice's steps: the request's queue, tagged with the choice."""

    queue: asyncio.Queue[tuple[int, Step | None | BaseException]]
    index: int

    def put_nowait(self, item: Step | None | BaseException) -> None:
        self.queue.put_nowait((self.index, item))
