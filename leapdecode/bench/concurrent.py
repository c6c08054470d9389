"""Many requests at once (`leapdecode bench --concurrency 1,2,4,8`): closed-loop clients on the
engine's batch scheduler, in process.

For each method and each concurrency C, C clients each keep one request in flight: when one
ends, that client sends the next prompt, until every prompt has been answered once. Reported:
aggregate new tokens per second (all requests' tokens over the wall time), per-request latency
(p50, p95) and time to first token (p50), passes and rows per pass, and the lossless check per
request: its tokens against the same prompt decoded alone with plain decoding. `solo` is the
one-at-a-time path every earlier release served (`Decoder.stream`, no shared passes), the
reference for one client's latency.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from leapdecode.api import Decoder
from leapdecode.engine.cost import ForwardCost, measure_batch_cost
from leapdecode.engine.scheduler import BatchScheduler, Submission
from leapdecode.methods import backend_for, parse_method
from leapdecode.models import LoadedModel

SOLO = "solo"  # the concurrency label of one request at a time without the scheduler


@dataclass
class ConcurrentResult:
    """One method at one concurrency, over every prompt."""

    method: str
    concurrency: str  # "1", "2", ..., or SOLO
    requests: int
    new_tokens: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    identical: int = 0  # requests whose tokens equal plain decoding's alone
    passes: int = 0
    rows: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # each request's tokens, in prompt order

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def percentile(self, values: Sequence[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("latencies_s")
        data.pop("first_token_s")
        data.pop("outputs")
        data.update(
            tokens_per_s=self.tokens_per_s,
            latency_p50_s=self.percentile(self.latencies_s, 0.5),
            latency_p95_s=self.percentile(self.latencies_s, 0.95),
            first_token_p50_s=self.percentile(self.first_token_s, 0.5),
            rows_per_pass=self.rows / self.passes if self.passes else 0.0,
        )
        return data


def run_solo(
    decoder: Decoder, prompts: Sequence[list[int]], max_new_tokens: int, reference: Sequence[list[int]] | None
) -> ConcurrentResult:
    """One request after another through `Decoder.stream`: no scheduler, no shared passes
    (`reference` None: this run is the reference, plain decoding's own)."""
    result = ConcurrentResult(str(decoder.method), SOLO, len(prompts), 0, 0.0)
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
) -> ConcurrentResult:
    """`concurrency` closed-loop clients over `prompts` on one `BatchScheduler`."""
    scheduler = BatchScheduler(decoder.backend, cost, max_batch=concurrency, max_rows=max_rows)
    result = ConcurrentResult(str(decoder.method), str(concurrency), len(prompts), 0, 0.0)
    outputs: dict[int, list[int]] = {}
    sent: dict[int, float] = {}
    queue = list(range(len(prompts)))
    in_flight = [0]

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

        scheduler.submit(Submission(decoder.start(prompts[i], max_new_tokens=max_new_tokens), on_step, on_end))

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
    return result


def run_concurrency_bench(
    lm: LoadedModel,
    methods: Sequence[str],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    concurrencies: Sequence[int],
    *,
    max_rows: int = 128,
    log: Callable[[str], None],
) -> list[ConcurrentResult]:
    """Every method solo and at every concurrency; plain decoding alone (`ar` solo, first) gives
    the reference outputs."""
    plain = Decoder(lm, "ar")
    plain.generate(prompts[0], max_new_tokens=8)  # warm the kernels
    log(f"ar: one at a time (the reference), {len(prompts)} prompts")
    reference = run_solo(plain, prompts, max_new_tokens, None)
    log(f"measuring the cost of shared passes (1..{max_rows} tokens over up to {max(concurrencies)} requests)")
    cost = measure_batch_cost(backend_for(lm), max_rows, max(concurrencies))
    results: list[ConcurrentResult] = []
    for method in methods:
        decoder = plain if str(parse_method(method)) == str(plain.method) else Decoder(lm, method)
        if decoder is plain:
            results.append(reference)
        else:
            decoder.generate(prompts[0], max_new_tokens=8)  # warm: the method's own cost curve
            log(f"{method}: one at a time")
            results.append(run_solo(decoder, prompts, max_new_tokens, reference.outputs))
        for concurrency in concurrencies:
            log(f"{method}: {concurrency} at once")
            results.append(
                run_concurrent(decoder, cost, prompts, max_new_tokens, concurrency, reference.outputs, max_rows)
            )
    return results


def concurrency_table(results: Sequence[ConcurrentResult]) -> str:
    """A Markdown table: one row per method and concurrency, with the aggregate against the
    method's own one-at-a-time rate."""
    solo = {r.method: r.tokens_per_s for r in results if r.concurrency == SOLO}
    lines = [
        "| method | clients | tok/s (all) | vs solo | p50 latency s | p95 latency s | first token p50 s | rows/pass | "
        "identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r.summary()
        ratio = r.tokens_per_s / solo[r.method] if solo.get(r.method) else 0.0
        lines.append(
            f"| {r.method} | {r.concurrency} | {r.tokens_per_s:.1f} | {ratio:.2f}x | {s['latency_p50_s']:.2f} | "
            f"{s['latency_p95_s']:.2f} | {s['first_token_p50_s']:.3f} | {s['rows_per_pass']:.1f} | "
            f"{r.identical}/{r.requests} |"
        )
    return "\n".join(lines) + "\n"
