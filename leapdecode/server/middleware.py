"""ASGI middleware that refuses a request before any route reads it: an oversized body, a Host
header not allowed (DNS rebinding), a /v1 request without the API key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leapdecode.server.config import ServerConfig
from leapdecode.server.errors import ApiError, AsciiJSONResponse
from leapdecode.server.metrics import Metrics


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
    """Raised out of the counting `receive` to abandon a body that grew past the limit."""


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
