"""The HTTP connection under the app: uvicorn's h11 protocol with a time limit on a request's
headers, a limit on open connections answered the OpenAI way, and JSON for every refusal it makes.

A client that opens a connection and sends its request line and headers a byte at a time holds
that connection as long as it likes under uvicorn alone (its keep-alive timer stops at the first
byte), and enough such clients lock every other one out (`--max-connections`). Here each request
must have its headers whole within `header_timeout_s` of the connection opening, or of the last
response on it; past that a client that began a request gets an OpenAI-style 408 and the
connection is closed (an idle one is closed quietly, as a keep-alive timeout would), as nginx's
`client_header_timeout` does. The body has its own limit (`middleware.BodyLimit`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def refusal(
    status: str, message: str, code: str, *, type_: str = "invalid_request_error", retry_after: int = 0
) -> bytes:
    """A raw OpenAI-style error response that closes the connection (`status`: "408 Request
    Timeout"), for refusals made below the app, before or instead of a request it would see."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    retry = f"retry-after: {retry_after}\r\n" if retry_after else ""
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{retry}connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def header_timeout_response(seconds: float) -> bytes:
    """The 408 a client whose headers did not arrive in time gets, before its connection closes."""
    return refusal(
        "408 Request Timeout", f"The request headers did not arrive within {seconds:g} s.", "request_timeout"
    )


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol whose requests must send their headers within `header_timeout_s`,
    that refuses a connection past `max_connections` open ones with a 503 and `Retry-After`, and
    whose refusal of a request it cannot parse is OpenAI-style JSON too (uvicorn's own are plain
    text: a client reading `error.message` would get nothing)."""

    class GuardedH11(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_deadline: asyncio.TimerHandle | None = None
            self.started = False  # bytes of the next request have come (else the connection is idle)
            self.refused = False  # past the connection limit: answered 503, its data dropped

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                # answered at once; what the client sends meanwhile is read and dropped until it
                # closes or a second passes (closing on unread data would reset the connection,
                # and the client would lose the answer)
                self.refused = True
                message = f"The server holds its limit of {max_connections} connections; retry shortly."
                transport.write(
                    refusal(
                        "503 Service Unavailable", message, "too_many_connections", type_="server_error", retry_after=1
                    )
                )
                transport.write_eof()
                self.loop.call_later(1.0, transport.close)
                return
            self._arm()

        def send_400_response(self, msg: str) -> None:
            self._disarm()
            self.transport.write(
                refusal("400 Bad Request", f"{msg.rstrip('.')}: the connection is closed.", "invalid_request")
            )
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return
            self.started = True
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in: a request is under way
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on this connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.started = False
            self.header_deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None

        def _headers_late(self) -> None:
            self.header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.started:  # a request begun and not finished: say why (an idle one just closes)
                    self.transport.write(header_timeout_response(header_timeout_s))
                self.transport.close()

    return GuardedH11
