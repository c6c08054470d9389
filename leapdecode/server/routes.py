"""The HTTP routes: health, Prometheus metrics, models, completions and chat completions.

Each route finds the app's `ServerState` on `app.state.server`, checks the request on the event
loop (cheap), and hands the generation to the server's worker thread.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from leapdecode.api import encode_prompt
from leapdecode.errors import RequestError
from leapdecode.request import RequestSpec
from leapdecode.server.errors import ApiError
from leapdecode.server.jobs import Job
from leapdecode.server.openai_format import ChatFormat, Choice, CompletionFormat, StreamText, final_text, finish_reason
from leapdecode.server.schemas import ChatCompletionRequest, CompletionRequest
from leapdecode.server.worker import ServerState

DEFAULT_CHAT_MAX_TOKENS = 512  # when a chat request sets no limit (the OpenAI API allows up to the context)

router = APIRouter()


def state_of(request: Request) -> ServerState:
    """The app's `ServerState`, set by `create_app`."""
    state: ServerState = request.app.state.server
    return state


def check_model(state: ServerState, name: str) -> None:
    if name not in (state.config.model_name, state.lm.name):
        raise ApiError(
            404,
            f"The model '{name}' does not exist; this server serves '{state.config.model_name}'.",
            code="model_not_found",
            param="model",
        )


def check_body(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    check_model(state, body.model)
    if body.stream_options is not None and not body.stream:  # as the OpenAI API answers
        raise ApiError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    unsupported = body.unsupported()
    if unsupported:
        raise ApiError(
            400,
            f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported by this server",
            param=unsupported[0],
            code="unsupported_parameter",
        )


def make_jobs(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_tokens: int | None
) -> list[Job]:
    """The request's generations (one per choice, `n`), their options checked once
    (`RequestSpec`, the library's rules) and fitted to the model's context before they are
    admitted; a refusal names the OpenAI parameter it concerns."""
    lm, config = state.lm, state.config
    method = state.choose_method(body.leapdecode.method if body.leapdecode else None)
    if max_tokens is None:  # what the context leaves, up to a default (a prompt that fills it is refused below)
        max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, lm.max_context - len(prompt_ids)))
    prompt = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    try:
        spec = RequestSpec.of(
            max_new_tokens=max_tokens,
            stop=body.stop or [],
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            logprobs=body.logprob_count,
        )
        spec.fit(lm, prompt_ids)
    except RequestError as exc:
        param = {"max_new_tokens": "max_tokens", "prompt": prompt}.get(exc.param, exc.param)
        raise ApiError(400, str(exc).replace("max_new_tokens", "max_tokens"), param=param, code=exc.code) from exc
    if body.n > config.max_queue:
        raise ApiError(
            400,
            f"n={body.n} choices exceed what this server admits at once ({config.max_queue}, --max-queue)",
            param="n",
        )
    return Job(method, state.decoder_for, prompt_ids, spec, timeout_s=config.timeout_s).siblings(body.n)


async def respond(
    state: ServerState,
    jobs: list[Job],
    body: CompletionRequest | ChatCompletionRequest,
    form: CompletionFormat | ChatFormat,
    endpoint: str,
    request: Request,
) -> Any:
    """Stream the choices' chunks, or run them to the end and return the whole response."""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        texts = [
            StreamText(state.lm.tokenizer, list(job.spec.stop), functools.partial(form.chunk, index=i))
            for i, job in enumerate(jobs)
        ]
        events = state.stream(jobs, texts, include_usage, endpoint)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    steps = await state.complete(jobs, endpoint, request)
    choices = [
        Choice(final_text(state.lm.tokenizer, s, list(job.spec.stop)), finish_reason(job.finish_reason), s)
        for job, s in zip(jobs, steps)
    ]
    return form.response(choices, len(jobs[0].prompt_ids), jobs[0].method_name, jobs[0].cached_tokens)


@router.get("/health")
@router.head("/health", include_in_schema=False)  # HEAD wherever GET is served
async def health(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {
        "status": "ok",
        "model": state.config.model_name,
        "admitted": state.admitted,
        "max_queue": state.config.max_queue,
    }


@router.get("/metrics")
@router.head("/metrics", include_in_schema=False)  # HEAD wherever GET is served
async def prometheus(request: Request) -> PlainTextResponse:
    return PlainTextResponse(
        generate_latest(state_of(request).metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST
    )


@router.get("/v1/models")
@router.head("/v1/models", include_in_schema=False)  # HEAD wherever GET is served
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    card = {"id": state.config.model_name, "object": "model", "created": state.created, "owned_by": "leapdecode"}
    return {"object": "list", "data": [card]}


@router.get("/v1/models/{model_id:path}")
@router.head("/v1/models/{model_id:path}", include_in_schema=False)  # HEAD wherever GET is served
async def model_card(model_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    check_model(state, model_id)
    return {"id": state.config.model_name, "object": "model", "created": state.created, "owned_by": "leapdecode"}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = state_of(request)
    check_body(state, body)
    prompt_ids = await asyncio.to_thread(
        encode_prompt, state.lm, body.prompt
    )  # a long prompt must not stall the event loop
    jobs = make_jobs(state, body, prompt_ids, body.max_tokens)
    form = CompletionFormat(state.config.model_name, state.lm.tokenizer, jobs[0].spec.logprobs is not None)
    return await respond(state, jobs, body, form, "/v1/completions", request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = state_of(request)
    check_body(state, body)
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
    prompt_ids = await asyncio.to_thread(encode_prompt, state.lm, messages)
    jobs = make_jobs(state, body, prompt_ids, body.token_limit)
    form = ChatFormat(state.config.model_name, state.lm.tokenizer, jobs[0].spec.logprobs is not None)
    return await respond(state, jobs, body, form, "/v1/chat/completions", request)
