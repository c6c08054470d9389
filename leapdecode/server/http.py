"""The HTTP connection under the app: uvicorn's h11 protocol with a time limit on a request's
headers.

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


def header_timeout_response(seconds: float) -> bytes:
    """The raw 408 a client whose headers did not arrive in time gets, before its connection closes."""
    body = json.dumps(
        {
            "error": {
                "message": f"The request headers did not arrive within {seconds:g} s.",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol whose requests must send their headers within `header_timeout_s`."""

    class HeaderTimeoutH11(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_deadline: asyncio.TimerHandle | None = None
            self.started = False  # bytes of the next request have come (else the connection is idle)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
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

    return HeaderTimeoutH11
