"""An OpenAI-compatible HTTP server that decodes with leapdecode's methods.

Requests are served one at a time per model (two CPU cores gain nothing from interleaving
them): a single worker thread runs the decode loop, and at most `max_queue` requests are
admitted at once (running plus waiting). Beyond that a request gets 429 at once, never a hang.
Each request has a time limit; a streaming client that disconnects stops its generation at the
next decoding step, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from leapdecode.api import Decoder, encode_prompt
from leapdecode.engine import Step, truncate_at_stop
from leapdecode.errors import LeapDecodeError, MethodError
from leapdecode.methods import parse_method
from leapdecode.models import LoadedModel
from leapdecode.server.schemas import ChatCompletionRequest, CompletionRequest
from leapdecode.textstream import TextStream

DEFAULT_CHAT_MAX_TOKENS = 512  # when a chat request sets no limit (the OpenAI API allows up to the context)


class ApiError(Exception):
    """An error returned with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class Metrics:
    """Prometheus metrics in a registry of this app's own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("leapdecode_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("leapdecode_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("leapdecode_generated_tokens", "Tokens generated", registry=r)
        self.forward_passes = Counter("leapdecode_forward_passes", "Target-model forward passes", registry=r)
        self.drafted_tokens = Counter("leapdecode_drafted_tokens", "Drafted tokens", registry=r)
        self.accepted_tokens = Counter("leapdecode_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.tau = Gauge("leapdecode_mean_accepted_tokens_per_pass", "Generated tokens / forward passes (tau)", registry=r)
        self.alpha = Gauge("leapdecode_draft_hit_ratio", "Accepted / drafted tokens (alpha)", registry=r)
        self.queue_depth = Gauge("leapdecode_queue_depth", "Admitted requests waiting for the model", registry=r)
        self.running = Gauge("leapdecode_running_requests", "Requests being decoded", registry=r)
        self.latency = Histogram(
            "leapdecode_request_latency_seconds", "Request latency", ["endpoint"], registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, float("inf")),
        )
        self.first_token = Histogram(
            "leapdecode_time_to_first_token_seconds", "Time to first token (streaming)", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, float("inf")),
        )
        self._totals = [0, 0, 0, 0]  # generated, passes, drafted, accepted

    def record(self, prompt_tokens: int, steps: list[Step]) -> None:
        generated = sum(len(s.tokens) for s in steps)
        drafted = sum(len(s.drafted) for s in steps)
        accepted = sum(s.num_accepted for s in steps)
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        self.forward_passes.inc(len(steps))
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        t = self._totals
        t[0] += generated
        t[1] += len(steps)
        t[2] += drafted
        t[3] += accepted
        self.tau.set(t[0] / t[1] if t[1] else 0.0)
        self.alpha.set(t[3] / t[2] if t[2] else 0.0)


@dataclass
class Job:
    """One admitted request's generation, run on the worker thread."""

    decoder: Decoder
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    temperature: float
    top_p: float
    seed: int | None
    deadline: float
    cancel: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = "length"
    timed_out: bool = False

    def steps(self) -> Iterator[Step]:
        """The decode loop's steps, stopping early on cancel (client gone) or the deadline."""
        stream = self.decoder.stream(
            self.prompt_ids, max_new_tokens=self.max_tokens, stop=self.stop,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed,
        )
        for step in stream:
            if self.cancel.is_set():
                self.finish_reason = "cancelled"
                return
            yield step
            if step.finish_reason:
                self.finish_reason = step.finish_reason
                return
            if time.monotonic() > self.deadline:
                self.timed_out = True
                return


class StopStringHolder:
    """Holds back streamed text that could still turn out to begin a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, delta: str, final: bool) -> str:
        self.text += delta
        cut = truncate_at_stop(self.text, self.stops)
        end = len(cut) if (final or len(cut) < len(self.text)) else max(self.sent, len(self.text) - self.hold)
        out = cut[self.sent : end]
        self.sent = max(self.sent, end)
        return out


@dataclass
class ServerConfig:
    model_name: str
    default_method: str = "anpd"
    max_queue: int = 8
    timeout_s: float = 120.0


def create_app(lm: LoadedModel, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `lm` under `config.model_name`."""
    parse_method(config.default_method)
    app = FastAPI(title="leapdecode", version="0.1.0")
    metrics = Metrics()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leapdecode-decode")
    default_decoder = Decoder(lm, config.default_method)  # loads a draft model, if any, once at start
    default_key = str(default_decoder.method)
    decoders: dict[str, Decoder] = {default_key: default_decoder}  # by canonical method string
    admitted = [0]  # running + waiting; touched only on the event loop's thread
    created = int(time.time())

    def decoder_for(method: str | None) -> Decoder:
        parsed = parse_method(method or config.default_method)
        key = str(parsed)  # "ANPD:k=7 " and "anpd:n=5,k=7" share one decoder
        if key not in decoders:
            if parsed.loads_files:
                # a client must not make the server load models or read paths it names
                raise MethodError(f"{key!r} loads files (a draft model or a datastore): choose it when the server starts (--method)")
            if len(decoders) >= 32:
                decoders.clear()
                decoders[default_key] = default_decoder
            decoders[key] = Decoder(lm, parsed)
        return decoders[key]

    def check_model(name: str) -> None:
        if name not in (config.model_name, lm.name):
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{config.model_name}'.", code="model_not_found", param="model")

    def make_job(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_tokens: int | None) -> Job:
        decoder = decoder_for(body.leapdecode.method if body.leapdecode else None)
        room = lm.max_context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(DEFAULT_CHAT_MAX_TOKENS, room)
        if max_tokens <= 0:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        decoder.check_request(prompt_ids, max_tokens)
        return Job(decoder, prompt_ids, max_tokens, list(body.stop or []), body.temperature, body.top_p, body.seed,
                   deadline=time.monotonic() + config.timeout_s)

    def admit() -> None:
        if admitted[0] >= config.max_queue:
            raise ApiError(429, f"The server is busy: {admitted[0]} requests are admitted (limit {config.max_queue}). Retry later.",
                           type_="rate_limit_error", code="queue_full")
        admitted[0] += 1
        metrics.queue_depth.set(admitted[0] - 1)

    def release() -> None:
        admitted[0] -= 1
        metrics.queue_depth.set(max(0, admitted[0] - 1))

    def run_blocking(job: Job) -> list[Step]:
        with metrics.running.track_inprogress():
            return list(job.steps())

    async def complete(job: Job, endpoint: str) -> tuple[list[Step], str, str]:
        """Run a non-streaming request; return its steps, text and finish reason."""
        admit()
        start = time.perf_counter()
        try:
            steps = await asyncio.get_running_loop().run_in_executor(executor, run_blocking, job)
        finally:
            release()
        if job.timed_out:
            raise ApiError(503, f"The request exceeded the server's time limit of {config.timeout_s:g} s.", type_="server_error", code="timeout")
        metrics.record(len(job.prompt_ids), steps)
        metrics.requests.labels(endpoint, "200").inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        token_ids = [t for s in steps for t in s.tokens]
        text = truncate_at_stop(lm.tokenizer.decode(token_ids, skip_special_tokens=True), job.stop)
        return steps, text, "stop" if job.finish_reason == "stop" else "length"

    def usage(job: Job, steps: list[Step]) -> dict[str, int]:
        completion = sum(len(s.tokens) for s in steps)
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion, "total_tokens": len(job.prompt_ids) + completion}

    def stats(job: Job, steps: list[Step]) -> dict[str, Any]:
        generated = sum(len(s.tokens) for s in steps)
        drafted = sum(len(s.drafted) for s in steps)
        accepted = sum(s.num_accepted for s in steps)
        return {"method": str(job.decoder.method), "forward_passes": len(steps), "drafted_tokens": drafted, "accepted_tokens": accepted,
                "tau": generated / len(steps) if steps else 0.0, "alpha": accepted / drafted if drafted else 0.0}

    def stream_response(job: Job, chunk: Callable[[str, str | None], dict[str, Any]], include_usage: bool, endpoint: str) -> StreamingResponse:
        admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Step | None | BaseException] = asyncio.Queue()

        def work() -> None:
            try:
                with metrics.running.track_inprogress():
                    for step in job.steps():
                        loop.call_soon_threadsafe(queue.put_nowait, step)
            except BaseException as exc:  # hand any failure to the event loop, which reports it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        def done(_: object) -> None:
            loop.call_soon_threadsafe(release)

        future = loop.run_in_executor(executor, work)
        future.add_done_callback(done)
        start = time.perf_counter()

        async def events() -> AsyncIterator[str]:
            steps: list[Step] = []
            detok = TextStream(lm.tokenizer)
            holder = StopStringHolder(job.stop)
            status = "200"
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    if not steps:
                        metrics.first_token.observe(time.perf_counter() - start)
                    steps.append(item)
                    delta = holder.push(detok.push(item.tokens), final=False)
                    if delta:
                        yield _sse(chunk(delta, None))
                if job.timed_out:
                    status = "503"
                    error = ApiError(503, f"The request exceeded the server's time limit of {config.timeout_s:g} s.", type_="server_error", code="timeout")
                    yield _sse({"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}})
                else:
                    tail = holder.push(detok.flush(), final=True)
                    if tail:
                        yield _sse(chunk(tail, None))
                    yield _sse(chunk("", "stop" if job.finish_reason == "stop" else "length"))
                    if include_usage:
                        yield _sse({**chunk("", None), "choices": [], "usage": usage(job, steps)})
                yield "data: [DONE]\n\n"
                metrics.record(len(job.prompt_ids), steps)
            except (asyncio.CancelledError, GeneratorExit):
                status = "499"  # the client went away: stop decoding at the next step
                job.cancel.set()
                raise
            finally:
                job.cancel.set()
                metrics.requests.labels(endpoint, status).inc()
                metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(LeapDecodeError)
    async def _input_error(request: Request, exc: LeapDecodeError) -> JSONResponse:
        metrics.requests.labels(request.url.path, "400").inc()
        return ApiError(400, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.requests.labels(request.url.path, "400").inc()
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return ApiError(400, "The request body is not valid JSON.").response()
        message = f"Invalid request: {loc + ': ' if loc else ''}{first.get('msg', 'invalid body')}"
        return ApiError(400, message, param=loc or None).response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name, "admitted": admitted[0], "max_queue": config.max_queue}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created, "owned_by": "leapdecode"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        check_model(body.model)
        prompt_ids = encode_prompt(lm, body.prompt)
        job = make_job(body, prompt_ids, body.max_tokens)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": now, "model": config.model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return stream_response(job, chunk, bool(body.stream_options and body.stream_options.include_usage), "/v1/completions")
        steps, text, finish = await complete(job, "/v1/completions")
        return {**chunk(text, finish), "usage": usage(job, steps), "leapdecode": stats(job, steps)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        prompt_ids = encode_prompt(lm, messages)
        job = make_job(body, prompt_ids, body.token_limit)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True]

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or finish is None else {}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": config.model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        if body.stream:
            return stream_response(job, chunk, bool(body.stream_options and body.stream_options.include_usage), "/v1/chat/completions")
        steps, text, finish = await complete(job, "/v1/chat/completions")
        return {
            "id": rid, "object": "chat.completion", "created": now, "model": config.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}],
            "usage": usage(job, steps), "leapdecode": stats(job, steps),
        }

    app.state.executor = executor
    return app


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
