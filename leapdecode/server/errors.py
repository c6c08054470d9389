"""Errors as the OpenAI API returns them, and the handlers that turn every failure into one.

Every error response is counted in /metrics by its handler, so that a client sees the same
status the counter records.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from leapdecode.errors import LeapDecodeError
from leapdecode.server.metrics import Metrics

logger = logging.getLogger("leapdecode")


class ApiError(Exception):
    """An error returned with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_s = retry_after_s  # sent as Retry-After, which the OpenAI clients wait for before retrying

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = None if self.retry_after_s is None else {"retry-after": str(self.retry_after_s)}
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=headers)


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote a client's text, lone surrogates included,
    which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def timeout_error(timeout_s: float) -> ApiError:
    """A request that ran past the server's time limit (streamed or not)."""
    return ApiError(
        503, f"The request exceeded the server's time limit of {timeout_s:g} s.", type_="server_error", code="timeout"
    )


def generation_failure(exc: BaseException) -> ApiError:
    """What a failure inside a streamed generation is reported as: the client's fault (400) for
    our own errors, else a server error, logged here, whose details stay in the log."""
    if isinstance(exc, LeapDecodeError):
        return ApiError(400, str(exc), type_="invalid_request_error")
    logger.error("a streamed request failed", exc_info=exc)
    return ApiError(500, "The server failed while generating; see its log.", type_="server_error")


def validation_error(exc: RequestValidationError) -> ApiError:
    """A body pydantic refused, named by the field at fault."""
    first = exc.errors()[0] if exc.errors() else {}
    # pydantic's location names validators and union members too ("function-after[...]", "str")
    loc = ".".join(
        str(p)
        for p in first.get("loc", ())
        if p != "body" and not any(c in str(p) for c in "[(") and p not in ("str", "int", "list")
    )
    if first.get("type") == "json_invalid":
        return ApiError(400, "The request body is not valid JSON.")
    message = f"Invalid request: {loc + ': ' if loc else ''}{first.get('msg', 'invalid body')}"
    return ApiError(400, message, param=loc or None)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error with an OpenAI-style body, counted in `metrics` by route and status."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(metrics.endpoint(request.scope), str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(LeapDecodeError)
    async def _input_error(request: Request, exc: LeapDecodeError) -> JSONResponse:
        metrics.requests.labels(metrics.endpoint(request.scope), "400").inc()
        return ApiError(400, str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.requests.labels(metrics.endpoint(request.scope), str(exc.status_code)).inc()
        messages = {
            404: f"No route {request.url.path}.",
            405: f"Method {request.method} is not allowed on {request.url.path}.",
        }
        return ApiError(
            exc.status_code, messages.get(exc.status_code, str(exc.detail)), code=str(exc.status_code)
        ).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("request to %s failed", request.url.path, exc_info=exc)
        metrics.requests.labels(metrics.endpoint(request.scope), "500").inc()
        return ApiError(500, "The server failed on this request; see its log.", type_="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.requests.labels(metrics.endpoint(request.scope), "400").inc()
        return validation_error(exc).response()
