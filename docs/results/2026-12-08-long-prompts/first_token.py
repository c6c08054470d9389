#!/usr/bin/env python
"""First-token times of short streamed requests sent beside a long prompt, and /health's worst
answer time meanwhile, at several --max-batch values: a server started per value, a long
completion prompt (about 2,000 tokens, 4 new) sent first, then four short streams 0.3 s apart.

    python docs/results/2026-12-08-long-prompts/first_token.py [--model smollm2-135m] [--batches 1,4,8]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time

PORT = 8792


def stream_first_token(body: dict, out: dict, key: str) -> None:
    """POST a streamed completion; record the seconds to its first token and to its end."""
    began = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        out[key + "_error"] = f"{response.status} {response.read()[:200]!r}"
    for line in response:
        if line.startswith(b"data: {") and key + "_first" not in out:
            out[key + "_first"] = round(time.monotonic() - began, 3)
    out[key + "_end"] = round(time.monotonic() - began, 3)
    conn.close()


def health_worst(stop: threading.Event, out: dict) -> None:
    worst, polls = 0.0, 0
    while not stop.is_set():
        began = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
        conn.request("GET", "/health")
        conn.getresponse().read()
        conn.close()
        worst, polls = max(worst, time.monotonic() - began), polls + 1
        time.sleep(0.1)
    out["health_worst_ms"], out["health_polls"] = round(worst * 1000, 1), polls


def run(model: str, batch: int, long_words: int) -> dict:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "leapdecode",
            "serve",
            "--model",
            model,
            "--port",
            str(PORT),
            "--method",
            "ar",
            "--max-batch",
            str(batch),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(1200):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        words = " ".join(f"word{i % 97} and" for i in range(long_words))
        out: dict = {"max_batch": batch}
        stop = threading.Event()
        poller = threading.Thread(target=health_worst, args=(stop, out))
        poller.start()
        threads = [
            threading.Thread(
                target=stream_first_token, args=({"model": model, "prompt": words, "max_tokens": 4}, out, "long")
            )
        ]
        threads[0].start()
        time.sleep(0.5)
        for i in range(4):
            thread = threading.Thread(
                target=stream_first_token,
                args=({"model": model, "prompt": f"Count to {i + 3}:", "max_tokens": 16}, out, f"short{i}"),
            )
            thread.start()
            threads.append(thread)
            time.sleep(0.3)
        for thread in threads:
            thread.join()
        stop.set()
        poller.join()
        return out
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--long-words", type=int, default=700)
    args = parser.parse_args()
    for batch in [int(b) for b in args.batches.split(",")]:
        print(json.dumps(run(args.model, batch, args.long_words)), flush=True)


if __name__ == "__main__":
    main()
