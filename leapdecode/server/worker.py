"""The model's side of the server: requests are admitted up to a bound and run by the one
scheduler (`server.batching`), and a request whose client left stops at its next pass.

At most `max_queue` generations are admitted at once (running plus waiting; a request with `n`
choices counts `n`), and beyond that a request gets 429 at once, never a hang. Each generation
has time limits (`Job`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from leapdecode.api import Decoder
from leapdecode.engine import Step
from leapdecode.engine.cost import ForwardCost
from leapdecode.errors import MethodError
from leapdecode.methods import Method, backend_for, parse_method
from leapdecode.methods.base import cached_cost
from leapdecode.models import LoadedModel
from leapdecode.server.batching import BatchWorker, Sink, start_batching
from leapdecode.server.config import ServerConfig
from leapdecode.server.errors import ApiError, generation_failure, timeout_error
from leapdecode.server.jobs import Job
from leapdecode.server.metrics import Metrics
from leapdecode.server.openai_format import SSE_DONE, StreamText, finish_reason, sse, usage

logger = logging.getLogger("leapdecode")
COST_TOKENS = 17  # forward cost measured at start for 1..17 tokens; longer drafts extrapolate its slope
MAX_DECODERS = 32  # decoders kept for per-request methods; beyond, all but the served one are dropped


@dataclass
class ServerState:
    """What every route shares: the model, its decoders (by canonical method string, built on the
    event loop), the batch worker that runs every generation, and the count of admitted
    generations (touched on the event loop's thread only)."""

    lm: LoadedModel
    config: ServerConfig
    metrics: Metrics
    served: Method
    allowed: tuple[str, ...]  # method names a request may choose
    costs: dict[bool, ForwardCost]  # by "drafts a tree"
    default_decoder: Decoder
    batch: BatchWorker
    decoders: dict[str, Decoder] = field(default_factory=dict)
    decoders_lock: threading.Lock = field(default_factory=threading.Lock)
    admitted: int = 0  # generations running + waiting
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def start(
        cls, lm: LoadedModel, config: ServerConfig, metrics: Metrics, served: Method, allowed: tuple[str, ...]
    ) -> ServerState:
        """Measure the forward cost once per model (or read it as measured before on this
        machine), here (no request measures it, on the event loop or while another request
        decodes), and build the served method's decoder (a draft model, if any, loads once, at
        start)."""
        backend = backend_for(lm)
        costs = {tree: cached_cost(lm, backend, COST_TOKENS, logger.info, tree=tree) for tree in (False, True)}
        default_decoder = Decoder(lm, served, cost=costs[served.drafts == "tree"])
        batch = start_batching(lm, config, metrics)
        state = cls(lm, config, metrics, served, allowed, costs, default_decoder, batch)
        state.decoders[state.default_key] = default_decoder
        metrics.running.set_function(state.running)
        kept = batch.scheduler.prefix_cache
        metrics.prefix_cache_tokens.set_function(lambda: kept.tokens if kept is not None else 0)
        metrics.queue_depth.set_function(lambda: max(0, state.admitted - state.running()))
        return state

    def running(self) -> int:
        """Generations in the batch: prefilling or decoding."""
        return len(self.batch.scheduler.running)

    @property
    def default_key(self) -> str:
        return str(self.default_decoder.method)

    def choose_method(self, method: str | None) -> Method:
        """Parse and check a request's method on the event loop (cheap); built later, in the worker."""
        parsed = parse_method(method) if method else self.served
        if str(parsed) == self.default_key:
            return parsed
        if parsed.capabilities.loads_files:
            # a client must not make the server load models or read paths it names
            raise MethodError(
                f"{str(parsed)!r} loads files (a draft model or a datastore): choose it when the server starts "
                f"(--method)"
            )
        if parsed.name not in self.allowed:
            raise ApiError(
                400,
                f"method {parsed.name!r} is not allowed on this server; allowed: {', '.join(self.allowed)}",
                code="method_not_allowed",
                param="leapdecode.method",
            )
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
            raise ApiError(
                429,
                f"The server is busy: {self.admitted} requests are admitted (limit {self.config.max_queue}). Retry "
                f"later.",
                type_="rate_limit_error",
                code="queue_full",
                retry_after_s=1,
            )
        self.admitted += count

    def release(self, count: int = 1) -> None:
        self.admitted -= count

    async def complete(self, jobs: list[Job], endpoint: str, request: Request) -> list[list[Step]]:
        """Run a non-streaming request's choices (siblings sharing one cancel) and count them; a
        client that goes away cancels their generation at the next pass (or before it starts)."""
        self.admit(len(jobs))
        start = time.perf_counter()
        queues: list[asyncio.Queue[Step | None | BaseException]] = [asyncio.Queue() for _ in jobs]
        self._submit_all(jobs, queues)  # builds the method's decoder: may refuse it
        ended = await asyncio.gather(
            *(self._choice_batched(job, queue, request) for job, queue in zip(jobs, queues)), return_exceptions=True
        )
        failed = [e for e in ended if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        steps = [e for e in ended if not isinstance(e, BaseException)]
        if any(job.timed_out for job in jobs):  # (its siblings then leave as cancelled)
            raise timeout_error(self.config.timeout_s)
        if any(job.finish_reason == "cancelled" for job in jobs):  # counted in /metrics by the ApiError handler
            raise ApiError(499, "The client closed the request.", code="client_closed_request")
        for i, choice in enumerate(steps):
            prompt, cached = (len(jobs[0].prompt_ids), jobs[0].cached_tokens) if i == 0 else (0, 0)  # the prompt once
            self.metrics.record(prompt, choice, cached)
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return steps

    async def _choice_batched(
        self, job: Job, queue: asyncio.Queue[Step | None | BaseException], request: Request
    ) -> list[Step]:
        """One choice in the shared passes; one that fails or times out ends its siblings too."""
        try:
            steps = await self._complete_batched(job, queue, request)
        except BaseException:
            job.cancel.set()  # shared by the siblings: they leave at the next pass
            raise
        if job.timed_out:
            job.cancel.set()
        return steps

    async def _complete_batched(
        self, job: Job, queue: asyncio.Queue[Step | None | BaseException], request: Request
    ) -> list[Step]:
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
        for submitted, (job, sink) in enumerate(zip(jobs, sinks)):
            try:
                self.batch.submit(job, asyncio.get_running_loop(), sink, self.release)
            except BaseException:
                self.release(len(jobs) - submitted)
                job.cancel.set()  # shared by the siblings
                raise

    def stream(
        self, jobs: list[Job], texts: list[StreamText], include_usage: bool, endpoint: str
    ) -> AsyncIterator[str]:
        """Admit a request's choices now (429 before any byte is sent), start them in the batch
        (a bad method or request is refused here, before any byte is sent) and return their SSE
        lines; a client that goes away stops them at the next pass."""
        self.admit(len(jobs))
        queue: asyncio.Queue[tuple[int, Step | None | BaseException]] = asyncio.Queue()
        self._submit_all(jobs, [ChoiceSink(queue, i) for i in range(len(jobs))])
        return self._events(jobs, queue, texts, include_usage, endpoint, time.perf_counter())

    async def _events(
        self,
        jobs: list[Job],
        queue: asyncio.Queue[tuple[int, Step | None | BaseException]],
        texts: list[StreamText],
        include_usage: bool,
        endpoint: str,
        start: float,
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
                choices = [s for choice in steps for s in choice]
                yield texts[0].usage_line(usage(len(jobs[0].prompt_ids), choices, jobs[0].cached_tokens))
            yield SSE_DONE
            for i, choice in enumerate(steps):
                first = i == 0  # the prompt once
                prompt, cached = (len(jobs[0].prompt_ids), jobs[0].cached_tokens) if first else (0, 0)
                self.metrics.record(prompt, choice, cached)
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
