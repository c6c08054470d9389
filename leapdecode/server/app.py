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
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hmac
import ipaddress
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leapdecode.api import Decoder, check_request, encode_prompt
from leapdecode.engine import Step, truncate_at_stop
from leapdecode.engine.cost import ForwardCost, measure_forward_cost
from leapdecode.errors import LeapDecodeError, MethodError
from leapdecode.methods import METHODS, Method, backend_for, method_class, parse_method
from leapdecode.models import LoadedModel
from leapdecode.server.schemas import ChatCompletionRequest, CompletionRequest
from leapdecode.textstream import TextStream
from leapdecode.verifiers import TokenLogprob


# (text delta, finish reason, log-probabilities of the tokens behind it) -> one response or SSE chunk
Chunk = Callable[[str, "str | None", Sequence[TokenLogprob]], dict[str, Any]]

logger = logging.getLogger("leapdecode")
COST_TOKENS = 17  # forward cost measured at start for 1..17 tokens; longer drafts extrapolate its slope

DEFAULT_CHAT_MAX_TOKENS = 512  # when a chat request sets no limit (the OpenAI API allows up to the context)


class ApiError(Exception):
    """An error returned with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status)


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote a client's text, lone surrogates included,
    which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before it is read further
    (by its Content-Length, or by counting a chunked body as it arrives)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        error = ApiError(413, f"The request body exceeds the server's limit of {self.limit} bytes.", code="body_too_large")
        body = AsciiJSONResponse(error.body()).body
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: the Host header must be an allowed one (when any are set: DNS rebinding),
    and /v1 requests must carry the API key (when one is set), compared in constant time."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: Metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                self.metrics.requests.labels(scope.get("path", ""), str(error.status)).inc()
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        if self.config.allowed_hosts:
            host = headers.get("host", "")
            host = host[1:].split("]")[0] if host.startswith("[") else host.rsplit(":", 1)[0]
            if host not in self.config.allowed_hosts:
                return ApiError(400, f"Host {host!r} is not allowed.", code="invalid_host")
        if self.config.api_key and str(scope.get("path", "")).startswith("/v1"):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.config.api_key.encode()):
                return ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`.",
                                type_="authentication_error", code="invalid_api_key")
        return None


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
    # Method names a request may choose (`leapdecode.method`); None: the served method and every
    # lossless method that needs no file or model of its own.
    allow_methods: tuple[str, ...] | None = None
    api_key: str | None = None  # when set, every /v1 request needs `Authorization: Bearer KEY`
    allowed_hosts: tuple[str, ...] = ()  # when set, the Host header must be one of these (DNS rebinding)
    max_body_bytes: int = 4 << 20


def default_allowed_methods(served: Method) -> tuple[str, ...]:
    """The served method, plus the lossless engine methods that load no files or models."""
    names = [m.name for m in METHODS if m.lossless and not m.peer and not m.loads_files]
    return tuple(dict.fromkeys([served.name, *names]))


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def create_app(lm: LoadedModel, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `lm` under `config.model_name`."""
    served = parse_method(config.default_method)
    allowed = config.allow_methods if config.allow_methods is not None else default_allowed_methods(served)
    for name in allowed:
        method_class(name)  # unknown names fail at start, not per request
    app = FastAPI(title="leapdecode", version="0.1.0", default_response_class=AsciiJSONResponse)
    metrics = Metrics()
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(Guard, config=config, metrics=metrics)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leapdecode-decode")
    # Measured once per model, here: no request measures it (on the event loop, or while
    # another request decodes on the same model).
    logger.info("measuring the forward cost of 1..%d tokens (chains and trees)", COST_TOKENS)
    costs: dict[bool, ForwardCost] = {tree: measure_forward_cost(backend_for(lm), COST_TOKENS, tree=tree) for tree in (False, True)}

    def cost(method: Method) -> ForwardCost:
        return costs[method.drafts == "tree"]

    default_decoder = Decoder(lm, served, cost=cost(served))  # loads a draft model, if any, once at start
    default_key = str(default_decoder.method)
    decoders: dict[str, Decoder] = {default_key: default_decoder}  # by canonical method string; worker thread only
    admitted = [0]  # running + waiting; touched only on the event loop's thread
    created = int(time.time())

    def choose_method(method: str | None) -> Method:
        """Parse and check a request's method on the event loop (cheap); built later, in the worker."""
        parsed = parse_method(method) if method else served
        if str(parsed) == default_key:
            return parsed
        if parsed.loads_files:
            # a client must not make the server load models or read paths it names
            raise MethodError(f"{str(parsed)!r} loads files (a draft model or a datastore): choose it when the server starts (--method)")
        if parsed.name not in allowed:
            raise ApiError(400, f"method {parsed.name!r} is not allowed on this server; allowed: {', '.join(allowed)}",
                           code="method_not_allowed", param="leapdecode.method")
        return parsed

    def decoder_for(method: Method) -> Decoder:
        key = str(method)  # "ANPD:k=7 " and "anpd:n=5,k=7" share one decoder
        if key not in decoders:
            if len(decoders) >= 32:
                decoders.clear()
                decoders[default_key] = default_decoder
            decoders[key] = Decoder(lm, method, cost=cost(method))
        return decoders[key]

    def check_model(name: str) -> None:
        if name not in (config.model_name, lm.name):
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{config.model_name}'.", code="model_not_found", param="model")

    def check_body(body: CompletionRequest | ChatCompletionRequest) -> None:
        check_model(body.model)
        unsupported = body.unsupported()
        if unsupported:
            raise ApiError(400, f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported by this server",
                           param=unsupported[0], code="unsupported_parameter")

    def make_job(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_tokens: int | None) -> Job:
        method = choose_method(body.leapdecode.method if body.leapdecode else None)
        if len(prompt_ids) >= lm.max_context:
            raise ApiError(400, f"The prompt is too long: {len(prompt_ids)} tokens; model {config.model_name!r} takes at most "
                           f"{lm.max_context - 1}.", param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(DEFAULT_CHAT_MAX_TOKENS, lm.max_context - len(prompt_ids))
        if max_tokens <= 0:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        check_request(lm, prompt_ids, max_tokens)
        return Job(method, decoder_for, prompt_ids, max_tokens, list(body.stop or []), body.temperature, body.top_p, body.seed,
                   timeout_s=config.timeout_s, logprobs=body.logprob_count)

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

    async def complete(job: Job, endpoint: str, request: Request) -> tuple[list[Step], str, str]:
        """Run a non-streaming request; return its steps, text and finish reason. A client that
        goes away cancels its generation at the next step (or before it starts)."""
        admit()
        start = time.perf_counter()
        try:
            future = asyncio.get_running_loop().run_in_executor(executor, run_blocking, job)
            while True:
                done, _ = await asyncio.wait({future}, timeout=0.25)
                if done:
                    break
                if await request.is_disconnected():
                    job.cancel.set()
            steps = future.result()
        finally:
            release()
        if job.finish_reason == "cancelled":  # counted in /metrics by the ApiError handler, as every error is
            raise ApiError(499, "The client closed the request.", code="client_closed_request")
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

    def token_text(token: int) -> str:
        return lm.tokenizer.decode([token], skip_special_tokens=False)

    def chat_logprobs(records: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The chat API's `logprobs`: per token its text, UTF-8 bytes, log-probability and alternatives."""

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records],
                "refusal": None}

    def completion_logprobs(records: Sequence[TokenLogprob], offset: list[int]) -> dict[str, Any]:
        """The legacy completions API's `logprobs`: parallel lists, alternatives as {text: logprob}."""
        tokens, offsets = [], []
        for r in records:
            text = token_text(r.token)
            tokens.append(text)
            offsets.append(offset[0])
            offset[0] += len(text)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{token_text(t): v for t, v in r.top} for r in records], "text_offset": offsets}

    def step_logprobs(steps: list[Step]) -> list[TokenLogprob]:
        return [r for s in steps for r in s.logprobs or ()]

    def stats(job: Job, steps: list[Step]) -> dict[str, Any]:
        generated = sum(len(s.tokens) for s in steps)
        drafted = sum(len(s.drafted) for s in steps)
        accepted = sum(s.num_accepted for s in steps)
        return {"method": job.method_name, "forward_passes": len(steps), "drafted_tokens": drafted, "accepted_tokens": accepted,
                "tau": generated / len(steps) if steps else 0.0, "alpha": accepted / drafted if drafted else 0.0}

    def stream_response(job: Job, chunk: Chunk, include_usage: bool, endpoint: str) -> StreamingResponse:
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
            pending: list[TokenLogprob] = []  # log-probabilities not yet sent: they ride on the next chunk
            detok = TextStream(lm.tokenizer)
            holder = StopStringHolder(job.stop)
            status = "200"
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        status = "400" if isinstance(item, LeapDecodeError) else "500"
                        if status == "500":
                            logger.error("a streamed request failed", exc_info=item)
                        message = str(item) if status == "400" else "The server failed while generating; see its log."
                        error = ApiError(int(status), message, type_="invalid_request_error" if status == "400" else "server_error")
                        yield _sse(error.body())
                        yield "data: [DONE]\n\n"
                        return
                    if not steps:
                        metrics.first_token.observe(time.perf_counter() - start)
                    steps.append(item)
                    pending.extend(item.logprobs or ())
                    delta = holder.push(detok.push(item.tokens), final=False)
                    if delta:
                        yield _sse(chunk(delta, None, pending))
                        pending = []
                if job.timed_out:
                    status = "503"
                    error = ApiError(503, f"The request exceeded the server's time limit of {config.timeout_s:g} s.", type_="server_error", code="timeout")
                    yield _sse({"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}})
                else:
                    tail = holder.push(detok.flush(), final=True)
                    if tail:
                        yield _sse(chunk(tail, None, pending))
                        pending = []
                    yield _sse(chunk("", "stop" if job.finish_reason == "stop" else "length", pending))
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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status_code)).inc()
        messages = {404: f"No route {request.url.path}.", 405: f"Method {request.method} is not allowed on {request.url.path}."}
        return ApiError(exc.status_code, messages.get(exc.status_code, str(exc.detail)), code=str(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("request to %s failed", request.url.path, exc_info=exc)
        metrics.requests.labels(request.url.path, "500").inc()
        return ApiError(500, "The server failed on this request; see its log.", type_="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.requests.labels(request.url.path, "400").inc()
        first = exc.errors()[0] if exc.errors() else {}
        # pydantic's location names validators and union members too ("function-after[...]", "str")
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not any(c in str(p) for c in "[(") and p not in ("str", "int", "list"))
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

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return {"id": config.model_name, "object": "model", "created": created, "owned_by": "leapdecode"}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_body(body)
        prompt_ids = await asyncio.to_thread(encode_prompt, lm, body.prompt)  # a long prompt must not stall the event loop
        job = make_job(body, prompt_ids, body.max_tokens)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        offset = [0]  # characters of completion text before the next token, across chunks

        def chunk(text: str, finish: str | None, records: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
            logprobs = completion_logprobs(records, offset) if job.logprobs is not None else None
            return {"id": rid, "object": "text_completion", "created": now, "model": config.model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}

        if body.stream:
            return stream_response(job, chunk, bool(body.stream_options and body.stream_options.include_usage), "/v1/completions")
        steps, text, finish = await complete(job, "/v1/completions", request)
        return {**chunk(text, finish, step_logprobs(steps)), "usage": usage(job, steps), "leapdecode": stats(job, steps)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_body(body)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        prompt_ids = await asyncio.to_thread(encode_prompt, lm, messages)
        job = make_job(body, prompt_ids, body.token_limit)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True]

        def chunk(text: str, finish: str | None, records: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or finish is None else {}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if job.logprobs is not None:
                choice["logprobs"] = chat_logprobs(records)
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": config.model_name, "choices": [choice]}

        if body.stream:
            return stream_response(job, chunk, bool(body.stream_options and body.stream_options.include_usage), "/v1/chat/completions")
        steps, text, finish = await complete(job, "/v1/chat/completions", request)
        return {
            "id": rid, "object": "chat.completion", "created": now, "model": config.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": chat_logprobs(step_logprobs(steps)) if job.logprobs is not None else None}],
            "usage": usage(job, steps), "leapdecode": stats(job, steps),
        }

    app.state.executor = executor
    return app


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
