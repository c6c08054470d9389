"""A long prompt and four streaming chat clients behind it, against `leapdecode serve` on loopback:
each client's time to first token and largest gap between chunks.

    python fairness.py SOURCE_ROOT [MODEL] [SENTENCES]

SOURCE_ROOT is the leapdecode checkout whose server runs (put first on PYTHONPATH), so that two
commits are measured the same way in one session. The long request streams 16 tokens after a
prompt of SENTENCES numbered sentences (333: 7,274 tokens with Qwen2.5's tokenizer and chat
template); 0.5 s later four clients each stream 64 tokens of a short chat. Greedy, 2 threads, the
server's defaults otherwise (--max-queue 8, --timeout 120).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(url: str, model: str, messages: list[dict[str, str]], max_tokens: int, out: dict[str, object]) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    arrivals: list[float] = []
    status = None
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        status = resp.status_code
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter() - start)
            if '"error"' in line:
                status = json.loads(line[6:])["error"].get("code") or "error"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    out.update(
        status=status,
        ttft_s=arrivals[0] if arrivals else None,
        max_gap_s=max(gaps) if gaps else None,
        total_s=time.perf_counter() - start,
        chunks=len(arrivals),
    )


def main() -> None:
    root = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-coder-1.5b"
    sentences = int(sys.argv[3]) if len(sys.argv) > 3 else 333
    port = free_port()
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen(
        [sys.executable, "-m", "leapdecode", "serve", "-m", model, "--port", str(port), "--threads", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            if proc.poll() is not None:
                raise SystemExit(proc.stdout.read())
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        # text the model has to read whole (about 22 tokens a sentence with Qwen2.5's tokenizer)
        document = " ".join(
            f"Item {i}: the shipment of {i % 17} crates left dock {i % 5} on day {i % 30}." for i in range(sentences)
        )
        long_messages = [{"role": "user", "content": document + "\nWhich dock did item 7 leave from?"}]
        results: dict[str, dict[str, object]] = {"long": {}}
        threads = [threading.Thread(target=stream, args=(url, model, long_messages, 16, results["long"]))]
        threads[0].start()
        time.sleep(0.5)
        questions = [
            "Explain what a hash map is.",
            "Give me three tips for sleeping better.",
            "Translate 'good morning, friends' into Spanish and German.",
            "What is 17 times 23? Show the steps.",
        ]
        for i, question in enumerate(questions):
            results[f"client {i + 1}"] = {}
            threads.append(
                threading.Thread(
                    target=stream,
                    args=(url, model, [{"role": "user", "content": question}], 64, results[f"client {i + 1}"]),
                )
            )
            threads[-1].start()
        for t in threads:
            t.join()
        print(json.dumps({"commit": commit, "model": model, "sentences": sentences, "results": results}, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
