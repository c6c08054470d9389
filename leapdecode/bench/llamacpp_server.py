"""llama.cpp's server as a throughput peer for `bench --concurrency` (`--methods ...,llama-server`).

What a llama.cpp user serves many clients with: `llama-server` (built by `make llamacpp-tools`)
on the same GGUF and threads, with one parallel slot per client (`-np C`, continuous batching on)
and room for every slot's prompt and answer. The same closed-loop load as the engine's rows: C
clients each keep one request in flight (`POST /completion` with the prompt's token ids, greedy,
`n_predict` the same budget, no prompt cache carried between requests), until every prompt has
been answered once. Aggregate tok/s = every request's generated tokens over the wall time, as for
the engine; latency per request from the client; first token = the server's own prompt time for
the request (its `timings.prompt_ms`: the request is not streamed). `identical` counts the
requests whose tokens equal plain decoding's on this engine: llama.cpp's numerics differ from the
engine's, so some greedy texts part ways; it is reported, not required.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leapdecode.bench.concurrent_result import SOLO, ConcurrentResult
from leapdecode.bench.llamacpp_tools import tool_path
from leapdecode.errors import MethodError
from leapdecode.models import presets

SERVER = "llama-server"
LABEL = "llama-server"
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 3600.0


def gguf_of(model: str, cache_dir: Path) -> Path:
    """The GGUF file a model name stands for: a preset's (pulled already) or a .gguf path."""
    if presets.is_preset(model):
        return presets.locate(model, cache_dir, download=False)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise MethodError(f"{LABEL} runs GGUF files: give a preset or a .gguf path, not {model!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """`llama-server` running in a process of its own, for as long as the `with` block."""

    def __init__(self, gguf: Path, threads: int, slots: int, context_per_slot: int) -> None:
        self.port = _free_port()
        self.command = [
            str(tool_path(SERVER)), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(slots * context_per_slot), "--host", "127.0.0.1", "--port", str(self.port),
            "--no-webui", "--seed", "0",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()  # its log, read only to explain a failure (a pipe would fill)

    def __enter__(self) -> LlamaServer:
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MethodError(f"{SERVER} exited ({self.process.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise MethodError(f"{SERVER} did not answer /health within {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def tail(self) -> str:
        """The end of its log."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-500:]

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def complete(self, prompt_ids: list[int], max_new_tokens: int, cache_prompt: bool = False) -> dict[str, Any]:
        """One greedy completion of the prompt's token ids: the server's JSON answer (`cache_prompt`:
        a slot reuses what its cache shares with the prompt)."""
        body = {
            "prompt": prompt_ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            answer: dict[str, Any] = json.loads(response.read())
        return answer


def run_llama_server(
    gguf: Path,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    concurrency: int,
    reference: Sequence[list[int]],
    threads: int,
    solo: bool = False,
    cache_prompt: bool = False,
) -> ConcurrentResult:
    """`concurrency` closed-loop clients over `prompts` on a `llama-server` with that many slots
    (`solo`: one slot, one request at a time, labelled as the engine's one-at-a-time row;
    `cache_prompt`: its slots reuse cached prompt prefixes, as the engine's prefix cache does)."""
    context = max(len(p) for p in prompts) + max_new_tokens + 16
    result = ConcurrentResult.over(LABEL, SOLO if solo else str(concurrency), prompts, peer=True)
    outputs: dict[int, list[int]] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()
    queue = list(range(len(prompts)))
    with LlamaServer(gguf, threads, concurrency, context) as server:
        server.complete(prompts[0][:8], 4)  # warm

        def client() -> None:
            while True:
                with lock:
                    if not queue or failures:
                        return
                    i = queue.pop(0)
                began = time.perf_counter()
                try:
                    answer = server.complete(prompts[i], max_new_tokens, cache_prompt)
                    tokens = [int(t) for t in answer["tokens"]][:max_new_tokens]
                    prompt_s = float(answer["timings"]["prompt_ms"]) / 1000
                    cached = int(answer["timings"].get("cache_n", 0))  # prompt tokens its slot already held
                except Exception as exc:  # noqa: BLE001 - any failure of a request fails the run, reported below
                    with lock:
                        failures.append(exc)
                    return
                with lock:
                    result.latencies_s.append(time.perf_counter() - began)
                    result.first_token_s.append(prompt_s)
                    outputs[i] = tokens
                    result.cached_tokens += cached

        start = time.perf_counter()
        clients = [threading.Thread(target=client) for _ in range(concurrency)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        result.wall_s = time.perf_counter() - start
    if failures or len(outputs) != len(prompts):
        raise MethodError(f"{LABEL}: a request failed: {failures[0] if failures else 'no answer'}")
    result.outputs = [outputs[i] for i in range(len(prompts))]
    result.new_tokens = sum(len(t) for t in result.outputs)
    result.identical = sum(outputs[i] == want for i, want in enumerate(reference))
    return result  # passes and rows stay 0: the server does not report them
