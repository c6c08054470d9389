#!/usr/bin/env python
"""A probe of the server's HTTP edge from outside, over loopback sockets: each group of requests
with its answers counted (status, whether the body is OpenAI-style JSON, whether the connection
closed), slow-header sockets against the default limits while /health is polled, and a batch of
randomly mutated requests (no 5xx, no plain-text answer expected).

    python docs/results/2026-12-08-http-edge/probe.py [--model smollm2-135m] [--mutations 1000]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time

PORT = 8791
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def exchange(raw: bytes, wait: float = 10.0) -> tuple[int | None, bool, bool, bytes]:
    """Send `raw`, read until the server closes or `wait` passes: (first status, JSON body, closed, all bytes)."""
    sock = socket.create_connection(("127.0.0.1", PORT), timeout=wait)
    sock.sendall(raw)
    data, closed, deadline = b"", False, time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            closed = True
            break
        data += chunk
        if b"\r\n\r\n" in data and b"content-length" in data.lower():
            head, _, body = data.partition(b"\r\n\r\n")
            lengths = [
                line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            ]
            length = int(lengths[0])
            if len(body) >= length:
                sock.settimeout(0.5)  # a closing server closes at once
                deadline = min(deadline, time.monotonic() + 0.5)
    sock.close()
    status = int(data.split(b" ")[1]) if data.startswith(b"HTTP/1.1 ") else None
    body = data.partition(b"\r\n\r\n")[2]
    try:
        is_json = "error" in json.loads(body.split(b"HTTP/1.1")[0]) if status and status >= 400 else True
    except ValueError:
        is_json = False
    return status, is_json, closed, data


def request(method: str, path: str, body: bytes = b"", headers: list[str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", *(headers if headers is not None else ["Host: 127.0.0.1"])]
    if body and headers is None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def groups() -> dict[str, list[bytes]]:
    chat = json.dumps(CHAT).encode()
    hidden = request("GET", "/metrics")
    te_cl = ["Host: a", "Transfer-Encoding: chunked", "Content-Length: 5", "Content-Type: application/json"]
    return {
        "CL+TE with a request hidden after it": [request("POST", "/v1/chat/completions", b"0\r\n\r\n" + hidden, te_cl)],
        "trailing slash with a foreign Host": [
            request("POST", "/v1/chat/completions/", chat, ["Host: evil.example", f"Content-Length: {len(chat)}"])
        ],
        "bad framing": [
            request("POST", "/v1/chat/completions", chat, ["Host: a", f"Content-Length: {value}"])
            for value in ("-5", "+5", f"{len(chat)}, {len(chat)}", "5x", "99999999999999999999")
        ]
        + [request("POST", "/v1/chat/completions", chat, ["Host: a", f"Content-Length: {len(chat)}"] * 2)]
        + [
            request("POST", "/v1/chat/completions", b"", ["Host: a", f"Transfer-Encoding: {te}"])
            for te in ("gzip", "chunked, chunked")
        ]
        + [b"GET /v1/models\x00 HTTP/1.1\r\nHost: a\r\n\r\n", b"GET /v1/mod\xffels HTTP/1.1\r\nHost: a\r\n\r\n"]
        + [request("GET", "/health", headers=[]), request("GET", "/health", headers=["Host: a", "Host: b"])],
        "loose types": [
            request(
                "POST", "/v1/completions", json.dumps({"model": "m", "prompt": [True, False], "max_tokens": 2}).encode()
            ),
            request(
                "POST",
                "/v1/chat/completions",
                json.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}).encode(),
            ),
            request("POST", "/v1/chat/completions", json.dumps({**CHAT, "temperature": float("nan")}).encode()),
            request("POST", "/v1/chat/completions", json.dumps({**CHAT, "top_p": float("inf")}).encode()),
        ],
    }


def mutated(rng: random.Random) -> bytes:
    """A valid chat request with a few bytes replaced, inserted or dropped."""
    raw = bytearray(request("POST", "/v1/chat/completions", json.dumps(CHAT).encode()))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(raw))
        kind = rng.random()
        if kind < 0.4:
            raw[at] = rng.randrange(256)
        elif kind < 0.7:
            raw.insert(at, rng.choice(b'\x00\r\n:{}"\\ 0-+,\xff'))
        else:
            del raw[at]
    return bytes(raw)


def slow_headers(sockets: int, seconds: float) -> dict[str, object]:
    """`sockets` connections that send a header line every 2 s and never finish, while /health is
    polled every 0.25 s: how each ended, and /health's answers and worst time."""
    ends: collections.Counter[str] = collections.Counter()
    health: list[tuple[int | None, float]] = []
    stop = threading.Event()

    def dribble() -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", PORT), timeout=seconds + 5)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            began = time.monotonic()
            sock.settimeout(2.0)
            while time.monotonic() - began < seconds:
                try:
                    data = sock.recv(4096)
                except TimeoutError:
                    sock.sendall(b"X-Slow: 1\r\n")
                    continue
                status = data.split(b" ")[1].decode() if data.startswith(b"HTTP/1.1") else "closed"
                ends[f"{status} after {round(time.monotonic() - began)} s"] += 1
                return
            ends["still open"] += 1
        except OSError as exc:
            ends[type(exc).__name__] += 1

    def poll() -> None:  # the time to /health's whole answer (a new connection each time)
        while not stop.is_set():
            began = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
            try:
                conn.request("GET", "/health")
                answer = conn.getresponse()
                answer.read()
                health.append((answer.status, time.monotonic() - began))
            except OSError as exc:
                health.append((type(exc).__name__, time.monotonic() - began))  # type: ignore[arg-type]
            finally:
                conn.close()
            time.sleep(0.1)

    threads = [threading.Thread(target=dribble) for _ in range(sockets)]
    poller = threading.Thread(target=poll)
    poller.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    poller.join()
    return {
        "sockets": sockets,
        "ended": dict(ends),
        "health": dict(collections.Counter(str(s) for s, _ in health)),
        "health_worst_ms": round(max(t for _, t in health) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--mutations", type=int, default=1000)
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-m", "leapdecode", "serve", "--model", args.model, "--port", str(PORT), "--method", "ar"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                if exchange(request("GET", "/health"), wait=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        for name, raws in groups().items():
            answers = [exchange(raw) for raw in raws]
            counts = collections.Counter(
                (status, "json" if is_json else "text", "closed" if closed else "open", data.count(b"HTTP/1.1 "))
                for status, is_json, closed, data in answers
            )
            print(json.dumps({"group": name, "requests": len(raws), "answers": {str(k): v for k, v in counts.items()}}))
        rng = random.Random(0)
        raws = [mutated(rng) for _ in range(args.mutations)]
        counts = collections.Counter()
        # eight at a time: a mutation that shortens the body leaves the server waiting for the rest
        # (cut at --body-timeout), so each gets 3 s; no answer by then counts as None
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for status, is_json, _, _ in pool.map(lambda raw: exchange(raw, wait=3), raws):
                counts[(status, "json" if is_json else "text")] += 1
        print(
            json.dumps(
                {
                    "group": "mutated requests",
                    "requests": args.mutations,
                    "answers": {str(k): v for k, v in counts.items()},
                }
            )
        )
        print(json.dumps({"group": "slow headers, default limits", **slow_headers(70, 12.0)}), flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
