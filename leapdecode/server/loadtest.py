"""A bounded load test against a running server on loopback: concurrent clients, some of which
disconnect mid-stream and some of which abandon a non-streaming request (their read times out
and they leave). A client refused with 429 retries after a short wait, as the OpenAI clients do,
so every request is in the end admitted and ends its own way. Used by the tests and runnable by
hand:

    python -m leapdecode.server.loadtest --url http://127.0.0.1:8000 --clients 8 --requests 10 --pid PID

Expected outcomes are 200, 429 (queue full: rejected at once) and 503 (time limit); a stream cut
by its client and an abandoned request are expected too. Anything else is `unexpected`. At the
end the server must have freed every slot (`/health` admitted back to 0); with `--pid`, the
server's resident memory before and after is reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class LoadReport:
    requests: int = 0  # requests sent, each retry after a 429 counted again
    statuses: dict[str, int] = field(default_factory=dict)
    disconnected: int = 0
    abandoned: int = 0
    rejected: int = 0  # 429: the queue was full
    completed: int = 0
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    unexpected: list[str] = field(default_factory=list)
    admitted_after: int = -1  # /health's admitted requests once the load is over (0: every slot freed)
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_s) if self.latencies_s else 0.0

    @property
    def p95(self) -> float:
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("latencies_s")
        data.update(p50_s=self.p50, p95_s=self.p95, tokens_per_s=self.tokens_per_s)
        return data


ABANDON_AFTER_S = 2.0  # an abandoning client waits this long for a non-streaming answer, then leaves
IDLE_WAIT_S = 2.0  # once every slot is free, the wait before reading the server's memory: an idle
# server gives freed memory back to the system after half a second
RETRY_WAIT_S = 0.05  # a refused client waits this long, doubled at each refusal up to RETRY_WAIT_MAX_S
RETRY_WAIT_MAX_S = 0.5


def _with_retries(attempt: Callable[[], str], retry_s: float) -> None:
    """Send a request (`attempt`, which counts each answer and returns its status) again after
    each 429 until `retry_s` has passed."""
    deadline = time.monotonic() + retry_s
    wait = RETRY_WAIT_S
    while attempt() == "429" and time.monotonic() < deadline:
        time.sleep(wait)
        wait = min(2 * wait, RETRY_WAIT_MAX_S)


def _attempt(
    client: httpx.Client,
    model: str,
    index: int,
    disconnect: bool,
    max_tokens: int,
    report: LoadReport,
    lock: threading.Lock,
) -> str:
    """Send the request once, count its outcome and return its status."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Count from {index} to {index + 5}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    start = time.perf_counter()
    status, tokens, note = "error", 0, ""
    retry_after: str | None = None
    try:
        if index % 2 == 0:  # streaming
            with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
            ) as resp:
                status, retry_after = str(resp.status_code), resp.headers.get("retry-after")
                if resp.status_code == 200:
                    for line in resp.iter_lines():
                        if disconnect:  # leave after the first event: the server must free the slot
                            break
                        if line.startswith("data: {"):
                            payload = json.loads(line[6:])
                            if payload.get("usage"):
                                tokens = payload["usage"]["completion_tokens"]
                        if line == "data: [DONE]":
                            note = "done"
                else:
                    resp.read()
        elif disconnect:  # non-streaming, abandoned: the server must stop decoding it
            # a long answer, still decoding when its client leaves (unless the model ends it within the wait)
            long = {"role": "user", "content": f"Write a long essay, of many paragraphs, about the number {index}."}
            try:
                resp = client.post(
                    "/v1/chat/completions",
                    json={**body, "messages": [long], "max_tokens": max_tokens * 64},
                    timeout=ABANDON_AFTER_S,
                )
                status, retry_after = str(resp.status_code), resp.headers.get("retry-after")
                note = "done" if resp.status_code == 200 else ""
            except httpx.TimeoutException:
                status = "abandoned"
        else:
            resp = client.post("/v1/chat/completions", json=body)
            status, retry_after = str(resp.status_code), resp.headers.get("retry-after")
            if resp.status_code == 200:
                tokens = resp.json()["usage"]["completion_tokens"]
                note = "done"
    except httpx.HTTPError as exc:
        status = f"exception:{type(exc).__name__}"
    elapsed = time.perf_counter() - start
    with lock:
        report.requests += 1
        report.statuses[status] = report.statuses.get(status, 0) + 1
        if status == "abandoned":
            report.abandoned += 1
        elif status == "429":
            report.rejected += 1
            if retry_after is None:
                report.unexpected.append(f"request {index}: 429 without Retry-After")
        if status == "200":
            if disconnect and index % 2 == 0:
                report.disconnected += 1
            elif note == "done":
                report.completed += 1
                report.completion_tokens += tokens
                report.latencies_s.append(elapsed)
            else:
                report.unexpected.append(f"request {index}: 200 but not completed")
        elif status not in ("429", "503", "abandoned"):
            report.unexpected.append(f"request {index}: status {status}")
    return status


def _rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _admitted(url: str, settle_s: float) -> int:
    """The server's admitted requests, once they have had `settle_s` to drain."""
    deadline = time.monotonic() + settle_s
    while True:
        admitted = int(httpx.get(url + "/health", timeout=10).json()["admitted"])
        if admitted == 0 or time.monotonic() > deadline:
            return admitted
        time.sleep(0.2)


def run_load(
    url: str,
    model: str,
    clients: int = 8,
    requests: int = 10,
    disconnect_every: int = 4,
    max_tokens: int = 8,
    timeout_s: float = 300,
    pid: int | None = None,
    settle_s: float = 30.0,
    retry_s: float = 30.0,
) -> LoadReport:
    """`clients` threads each send `requests` requests in turn; every `disconnect_every`-th
    streaming request disconnects after its first event, and every `disconnect_every`-th
    non-streaming one is abandoned after `ABANDON_AFTER_S`. A request refused with 429 is sent
    again for up to `retry_s` (0: never)."""
    report = LoadReport(rss_before_mb=_rss_mb(pid))
    lock = threading.Lock()
    start = time.perf_counter()

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            for r in range(requests):
                index = c * requests + r
                leaves = disconnect_every > 0 and index // 2 % disconnect_every == 0  # streaming (even) or not (odd)
                attempt = functools.partial(_attempt, client, model, index, leaves, max_tokens, report, lock)
                _with_retries(attempt, retry_s)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.wall_s = time.perf_counter() - start
    report.admitted_after = _admitted(url, settle_s)
    if pid is not None:
        time.sleep(IDLE_WAIT_S)
    report.rss_after_mb = _rss_mb(pid)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--retry-s", type=float, default=30.0, help="how long a request refused with 429 is retried")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id, to report its resident memory")
    args = parser.parse_args()
    report = run_load(
        args.url,
        args.model,
        args.clients,
        args.requests,
        max_tokens=args.max_tokens,
        pid=args.pid,
        retry_s=args.retry_s,
    )
    print(json.dumps(report.summary(), indent=2))


if __name__ == "__main__":
    main()
