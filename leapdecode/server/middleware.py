"""ASGI middleware that refuses a request before any route sees it: an oversized body or one
sent too slowly, a Host header not allowed (DNS rebinding), a /v1 request without the API key.
Every refusal is counted in /metrics under its route's template (`Metrics.endpoint`)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leapdecode.errors import InputError
from leapdecode.server.config import ServerConfig
from leapdecode.server.errors import ApiError, AsciiJSONResponse
from leapdecode.server.metrics import Metrics

_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")  # a registered name or an IPv4 address, lower-cased
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class HostPort:
    """A Host header's host (lower-cased; an IPv6 address without its brackets) and port (None: not given)."""

    host: str
    port: int | None

    def allows(self, other: HostPort, default_port: int) -> bool:
        """Whether this configured value accepts `other`: the same host, and the same port when
        this one names a port (a request without one is on the scheme's default port)."""
        return self.host == other.host and (
            self.port is None or self.port == (other.port if other.port is not None else default_port)
        )


def parse_host(value: str) -> HostPort | None:
    """`host`, `host:port`, `[ipv6]` or `[ipv6]:port` as RFC 9110 writes a Host header; None
    when it is none of these (two ports, an address in brackets that is not IPv6, an empty host)."""
    text = value.strip().lower()
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or not _is_ipv6(inside):
            return None
        host = inside
    else:
        host, _, rest = text.partition(":")
        rest = text[len(host) :]
        if not _NAME.fullmatch(host):
            return None
    if not rest:
        return HostPort(host, None)
    port = rest[1:] if rest.startswith(":") else ""
    if not port.isdigit() or not port.isascii() or len(port) > 5 or int(port) > 65535:
        return None
    return HostPort(host, int(port))


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def allowed_hosts(values: tuple[str, ...]) -> tuple[HostPort, ...]:
    """The configured `--allowed-host` values, parsed (a malformed one is an error at start)."""
    parsed = []
    for value in values:
        host = parse_host(value)
        if host is None:
            raise InputError(f"--allowed-host {value!r} is not a host, host:port, [ipv6] or [ipv6]:port")
        parsed.append(host)
    return tuple(parsed)


def _refusal(error: ApiError, close: bool = False) -> tuple[Message, Message]:
    body = AsciiJSONResponse(error.body()).body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": error.status, "headers": headers}, {
        "type": "http.response.body",
        "body": body,
    }


class BodyLimit:
    """ASGI middleware: reads a request's whole body before the app does, and refuses one over
    `limit` bytes with 413 (by its Content-Length, or as a chunked body grows past it) and one
    that has not arrived whole within `timeout_s` with 408 (a client holding a half-sent body
    holds a connection, not the server); the app then reads the body from here. A request whose
    framing cannot be trusted (Content-Length beside Transfer-Encoding, or two Content-Lengths:
    RFC 9112 6.1, 6.3) is refused with 400 and its connection closed, so that nothing sent after
    it on that connection (a smuggled request) is served."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float, metrics: Metrics) -> None:
        self.app, self.limit, self.timeout_s, self.metrics = app, limit, timeout_s, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = [name.lower() for name, _ in scope.get("headers") or []]
        if names.count(b"content-length") > 1 or (b"content-length" in names and b"transfer-encoding" in names):
            error = ApiError(
                400,
                "The request's framing is ambiguous (Content-Length with Transfer-Encoding, or two "
                "Content-Lengths); the connection is closed.",
                code="invalid_framing",
            )
            await self._refuse(scope, send, error)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(scope, send, self._too_large())
            return
        chunks: list[bytes] = []
        seen = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                error = ApiError(
                    408, f"The request body did not arrive within {self.timeout_s:g} s.", code="request_timeout"
                )
                await self._refuse(scope, send, error)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._refuse(scope, send, self._too_large())
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: a disconnect, as the app's streams listen for

        await self.app(scope, replay, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413, f"The request body exceeds the server's limit of {self.limit} bytes.", code="body_too_large"
        )

    async def _refuse(self, scope: Scope, send: Send, error: ApiError) -> None:
        self.metrics.requests.labels(self.metrics.endpoint(scope), str(error.status)).inc()
        start, body = _refusal(error, close=True)  # the rest of the body is never read: the connection ends
        await send(start)
        await send(body)


class Guard:
    """ASGI middleware: the Host header must be an allowed one (when any are set: DNS rebinding),
    and /v1 requests must carry the API key (when one is set), compared in constant time."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: Metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        self.hosts = allowed_hosts(config.allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                self.metrics.requests.labels(self.metrics.endpoint(scope), str(error.status)).inc()
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        if self.hosts:
            given = headers.get("host", "")
            host = parse_host(given)
            if host is None:
                return ApiError(400, f"The Host header {given!r} is malformed.", code="invalid_host")
            default_port = DEFAULT_PORTS.get(str(scope.get("scheme", "http")), 80)
            if not any(allowed.allows(host, default_port) for allowed in self.hosts):
                return ApiError(400, f"Host {given!r} is not allowed.", code="invalid_host")
        if self.config.api_key and str(scope.get("path", "")).startswith("/v1"):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.config.api_key.encode()):
                return ApiError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer KEY`.",
                    type_="authentication_error",
                    code="invalid_api_key",
                )
        return None
