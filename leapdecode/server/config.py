"""What a server is started with: its configuration, and the defaults it derives from it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from leapdecode.methods import METHODS, Method


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
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (408 beyond it)
    header_timeout_s: float = 5.0  # a request's headers must arrive whole within this (408, connection closed)
    max_connections: int = 64  # open connections at once; beyond, an OpenAI-style 503 (`server.http`)
    # Requests decoded together in shared passes (`server.batching`); None: chosen from the
    # measured cost curve where the model can share passes, else 1 (one request at a time).
    max_batch: int | None = None
    max_pass_rows: int = 128  # tokens one shared pass may score (pending, drafted and prompt tokens)
    # Tokens of finished requests' caches kept for requests that begin the same way (a chat's
    # history, a system prompt: `engine.prefix_cache`); 0: every prompt is prefilled whole; None:
    # 8,192, or what 1 GiB of keys and values holds where that is fewer (`server.batching`).
    prefix_cache_tokens: int | None = None


def default_allowed_methods(served: Method) -> tuple[str, ...]:
    """The served method, plus the lossless engine methods that load no files or models."""
    names = [m.name for m in METHODS if m.kind.lossless and not m.kind.peer and not m.kind.loads_files]
    return tuple(dict.fromkeys([served.name, *names]))


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (the CLI warns when serving beyond it with no key)."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
