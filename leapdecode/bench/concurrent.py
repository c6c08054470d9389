"""Many requests at once (`leapdecode bench --concurrency 1,2,4,8`): closed-loop clients on the
engine's batch scheduler, in process.

For each method and each concurrency C, C clients each keep one request in flight: when one
ends, that client sends the next prompt, until every prompt has been answered once. At each
concurrency the methods take turns (the order rotating), and with several rounds each cell is
every round's requests together, so that methods compared at one concurrency ran in the same
minutes of a machine whose speed drifts. Reported:
aggregate new tokens per second (all requests' tokens over the wall time), per-request latency
(p50, p95) and time to first token (p50), passes and rows per pass, and the lossless check per
request: its tokens against the same prompt decoded alone with plain decoding. `solo` is the
one-at-a-time path every earlier release served (`Decoder.stream`, no shared passes), the
reference for one client's latency.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from leapdecode.api import Decoder
from leapdecode.bench.concurrent_result import SOLO, ConcurrentResult
from leapdecode.bench.labels import short_label
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.cost_measure import measure_batch_cost
from leapdecode.engine.prefix_cache import PrefixCache
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission
from leapdecode.errors import InputError, MethodError
from leapdecode.methods import LlamaCppServer, backend_for, parse_method
from leapdecode.models import LoadedModel


def run_solo(
    decoder: Decoder, prompts: Sequence[list[int]], max_new_tokens: int, reference: Sequence[list[int]] | None
) -> ConcurrentResult:
    """One request after another through `Decoder.stream`: no scheduler, no shared passes
    (`reference` None: this run is the reference, plain decoding's own)."""
    result = ConcurrentResult.over(str(decoder.method), SOLO, prompts)
    start = time.perf_counter()
    for prompt in prompts:
        began = time.perf_counter()
        tokens: list[int] = []
        for step in decoder.stream(prompt, max_new_tokens=max_new_tokens):
            if not tokens:
                result.first_token_s.append(time.perf_counter() - began)
            tokens.extend(step.tokens)
            result.passes += 1
            result.rows += 1 + len(step.drafted)
        result.latencies_s.append(time.perf_counter() - began)
        result.new_tokens += len(tokens)
        result.outputs.append(tokens)
    result.wall_s = time.perf_counter() - start
    result.identical = sum(
        a == b for a, b in zip(result.outputs, reference if reference is not None else result.outputs)
    )
    return result


def run_concurrent(
    decoder: Decoder,
    cost: ForwardCost,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    concurrency: int,
    reference: Sequence[list[int]],
    max_rows: int,
    prefix_cache_tokens: int = 0,
) -> ConcurrentResult:
    """`concurrency` closed-loop clients over `prompts` on one `BatchScheduler` (with a prefix
    cache of `prefix_cache_tokens` tokens, none at 0)."""
    prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
    scheduler = BatchScheduler(
        decoder.backend, cost, max_batch=concurrency, max_rows=max_rows, prefix_cache=prefix_cache
    )
    result = ConcurrentResult.over(str(decoder.method), str(concurrency), prompts)
    outputs: dict[int, list[int]] = {}
    sent: dict[int, float] = {}
    queue = list(range(len(prompts)))
    in_flight = [0]
    submissions: list[Submission] = []

    def send() -> None:
        i = queue.pop(0)
        outputs[i] = []
        sent[i] = time.perf_counter()
        in_flight[0] += 1

        def on_step(step: Any, i: int = i) -> None:
            if not outputs[i]:
                result.first_token_s.append(time.perf_counter() - sent[i])
            outputs[i].extend(step.tokens)

        def on_end(reason: str, i: int = i) -> None:
            result.latencies_s.append(time.perf_counter() - sent[i])
            in_flight[0] -= 1

        submissions.append(
            scheduler.submit(Submission(decoder.start(prompts[i], max_new_tokens=max_new_tokens), on_step, on_end))
        )

    start = time.perf_counter()
    while queue and in_flight[0] < concurrency:
        send()
    while in_flight[0]:
        report = scheduler.step()
        if report is not None:
            result.passes += 1
            result.rows += report.rows
        while queue and in_flight[0] < concurrency:
            send()
    result.wall_s = time.perf_counter() - start
    result.new_tokens = sum(len(t) for t in outputs.values())
    result.outputs = [outputs[i] for i in range(len(prompts))]
    result.identical = sum(outputs[i] == want for i, want in enumerate(reference))
    result.cached_tokens = sum(s.cached_tokens for s in submissions)
    return result


Cell = Callable[[str], ConcurrentResult]  # a method's run at one concurrency label ("1", ..., or SOLO)


def run_concurrency_bench(
    lm: LoadedModel,
    methods: Sequence[str],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    concurrencies: Sequence[int],
    *,
    max_rows: int = 128,
    gguf: Path | None = None,
    prefix_cache_tokens: int = 0,
    rounds: int = 1,
    log: Callable[[str], None],
) -> list[ConcurrentResult]:
    """Every method solo and at every concurrency, interleaved: at each concurrency every method
    runs in turn (the order rotating), `rounds` times over, so that the methods compared at one
    concurrency ran in the same minutes of a machine whose speed drifts; a method's rounds at a
    concurrency are merged. Plain decoding alone first gives the reference outputs (and warms the
    kernels). `llama-server` (a peer) runs on `gguf`, the same threads, the same load.
    `prefix_cache_tokens`: the shared passes keep finished requests' caches for prompts that begin
    the same way (`llama-server` then caches prompts too); 0: every prompt prefilled whole."""
    if rounds < 1:
        raise InputError(f"rounds must be >= 1, got {rounds}")
    parsed = {method: parse_method(method) for method in methods}
    if gguf is None and any(isinstance(p, LlamaCppServer) for p in parsed.values()):
        from leapdecode.bench.llamacpp_server import LABEL

        raise MethodError(f"{LABEL} needs the model's GGUF file (a preset or a .gguf path)")
    plain = Decoder(lm, "ar")
    plain.generate(prompts[0], max_new_tokens=8)  # warm the kernels
    log(f"ar: one at a time (the reference), {len(prompts)} prompts")
    reference = run_solo(plain, prompts, max_new_tokens, None).outputs
    log(f"measuring the cost of shared passes (1..{max_rows} tokens over up to {max(concurrencies)} requests)")
    cost = measure_batch_cost(backend_for(lm), max_rows, max(concurrencies))
    cells: dict[str, Cell] = {}
    for method, method_parsed in parsed.items():
        if isinstance(method_parsed, LlamaCppServer):
            assert gguf is not None
            cells[method] = _server_cell(gguf, prompts, max_new_tokens, reference, prefix_cache_tokens > 0)
            continue
        decoder = plain if str(method_parsed) == str(plain.method) else Decoder(lm, method_parsed)
        decoder.generate(prompts[0], max_new_tokens=8)  # warm: the method's own cost curve
        cells[method] = functools.partial(
            _engine_cell, decoder, cost, prompts, max_new_tokens, reference, max_rows, prefix_cache_tokens
        )
    labels = [SOLO, *(str(c) for c in concurrencies)]
    runs: dict[tuple[str, str], list[ConcurrentResult]] = {}
    for round_ in range(rounds):
        for j, label in enumerate(labels):
            shift = (round_ + j) % len(methods)
            for method in [*methods[shift:], *methods[:shift]]:
                at = "one at a time" if label == SOLO else f"{label} at once"
                log(f"round {round_ + 1}/{rounds}, {at}: {method}")
                runs.setdefault((method, label), []).append(cells[method](label))
    return [ConcurrentResult.merged(runs[(method, label)]) for method in methods for label in labels]


def _engine_cell(
    decoder: Decoder,
    cost: ForwardCost,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    reference: Sequence[list[int]],
    max_rows: int,
    prefix_cache_tokens: int,
    label: str,
) -> ConcurrentResult:
    """An engine method one at a time (`run_solo`) or with `label` clients at once."""
    if label == SOLO:
        return run_solo(decoder, prompts, max_new_tokens, reference)
    return run_concurrent(decoder, cost, prompts, max_new_tokens, int(label), reference, max_rows, prefix_cache_tokens)


def _server_cell(
    gguf: Path,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    reference: Sequence[list[int]],
    cache_prompt: bool = False,
) -> Cell:
    """`llama-server` one request at a time (one slot), or with a slot per client (`cache_prompt`:
    those runs reuse cached prompt prefixes, as the engine's shared passes do with a prefix
    cache; one at a time never does, as the engine's never does). Without the cache, one client
    on one slot is one request at a time: the round's solo run stands for it."""
    from leapdecode.bench.llamacpp_server import run_llama_server

    threads = torch.get_num_threads()
    solo: list[ConcurrentResult] = []

    def run(label: str) -> ConcurrentResult:
        if label == SOLO:
            solo[:] = [run_llama_server(gguf, prompts, max_new_tokens, 1, reference, threads, solo=True)]
            return solo[0]
        if label == "1" and not cache_prompt and solo:
            return dataclasses.replace(solo[0], concurrency="1")
        return run_llama_server(
            gguf, prompts, max_new_tokens, int(label), reference, threads, cache_prompt=cache_prompt
        )

    return run


def concurrency_table(results: Sequence[ConcurrentResult]) -> str:
    """A Markdown table: one row per method and concurrency, with the aggregate against the
    method's own one-at-a-time rate, and each round's rate where there were several (each method
    by its short label; the JSON keeps it whole)."""
    solo = {r.method: r.tokens_per_s for r in results if r.concurrency == SOLO}
    lines = [
        "| method | clients | tok/s (all) | vs solo | p50 latency s | p95 latency s | first token p50 s | rows/pass | "
        "prompt tokens cached | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r.summary()
        ratio = r.tokens_per_s / solo[r.method] if solo.get(r.method) else 0.0
        rounds = f" ({', '.join(f'{rate:.1f}' for rate in r.round_rates)})" if len(r.round_rates) > 1 else ""
        lines.append(
            f"| {short_label(r.method)} | {r.concurrency} | {r.tokens_per_s:.1f}{rounds} | {ratio:.2f}x | "
            f"{s['latency_p50_s']:.2f} | {s['latency_p95_s']:.2f} | {s['first_token_p50_s']:.3f} | "
            f"{s['rows_per_pass']:.1f} | "
            f"{r.cached_tokens}/{r.prompt_tokens} | {r.identical}/{r.requests} |"
        )
    return "\n".join(lines) + "\n"
