"""The same prompts through vLLM: no speculation, vLLM's own proposers, and ours (`leapdecode vllm-bench`).

Each (proposer, concurrency) pair is one engine in its own process (`integrations.vllm_run`), all
on the same token ids and greedy. Concurrency 1 submits each prompt after the previous one
finished (per-request latency is the request's own time); concurrency C lets C run at once.
vLLM's own proposers are named `vllm-ngram[:k=K,n=N]` (its prompt lookup; n: longest and shortest
n-gram) and `vllm-suffix[:k=K]` (SuffixDecoding, needs `arctic-inference` in vLLM's venv);
`none` is no speculation; anything else is one of our methods (`vllm_setup.VLLM_METHODS`).
"""

from __future__ import annotations

import importlib.util
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leapdecode.bench.entries import group_method_strings
from leapdecode.bench.labels import short_label
from leapdecode.errors import MethodError
from leapdecode.integrations.vllm_run import VllmResult, VllmRun, run_in_subprocess
from leapdecode.integrations.vllm_setup import vllm_method

PLAIN = "none"


@dataclass(frozen=True)
class VllmEntry:
    label: str
    method: str | None = None  # ours
    speculative_config: dict[str, Any] | None = None  # vLLM's own


def parse_vllm_entries(text: str) -> list[VllmEntry]:
    """`none,vllm-ngram:k=7,n=3,anpd:n=5,k=7` → entries; items that do not start a new entry
    (`k=7` after `vllm-ngram:`) belong to the one before, as in `bench --methods`."""
    entries = [_entry(item) for item in group_method_strings(text)]
    if not entries:
        raise MethodError("no methods given")
    if entries[0].label != PLAIN:
        entries.insert(0, VllmEntry(PLAIN))  # the baseline runs first, for the ratios and the identity check
    return entries


def _entry(item: str) -> VllmEntry:
    name, _, params = item.partition(":")
    if name == PLAIN:
        return VllmEntry(PLAIN)
    if name in ("vllm-ngram", "vllm-suffix"):
        values = dict(p.split("=", 1) for p in params.split(",") if "=" in p)
        unknown = set(values) - ({"k", "n"} if name == "vllm-ngram" else {"k"})
        if unknown:
            raise MethodError(f"{name}: unknown parameter(s) {', '.join(sorted(unknown))}")
        try:
            k = int(values.get("k", 7))
            n = int(values.get("n", 3))
        except ValueError as exc:
            raise MethodError(f"{name}: k and n are integers ({exc})") from None
        if name == "vllm-ngram":
            config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": 1}
        else:
            if importlib.util.find_spec("arctic_inference") is None:  # say so now, not after the other runs
                raise MethodError(
                    "vllm-suffix needs Snowflake's arctic-inference in vLLM's environment: "
                    "`make peers VENV=.venv-vllm` builds it there (PyPI has only its source)"
                )
            config = {"method": "suffix", "num_speculative_tokens": k}
        return VllmEntry(item, speculative_config=config)
    return VllmEntry(str(vllm_method(item)), method=item)


@dataclass
class VllmRow:
    """One proposer at one concurrency, over all prompts and per category."""

    label: str
    concurrency: int
    result: VllmResult
    identical: int  # requests whose output equals no speculation's (same concurrency)


def run_vllm_bench(
    source: str,
    entries: Sequence[VllmEntry],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    concurrencies: Sequence[int],
    *,
    python: str,
    dtype: str,
    threads: int,
    max_model_len: int,
    log: Callable[[str], None],
) -> list[VllmRow]:
    rows: list[VllmRow] = []
    for concurrency in concurrencies:
        plain: VllmResult | None = None
        for entry in entries:
            log(f"vLLM: {entry.label}, concurrency {concurrency}, {len(prompts)} prompts")
            run = VllmRun(
                model=source,
                prompts=list(prompts),
                max_tokens=[max_new_tokens] * len(prompts),
                method=entry.method,
                speculative_config=entry.speculative_config,
                concurrency=concurrency,
                one_at_a_time=concurrency == 1,
                dtype=dtype,
                max_model_len=max_model_len,
                threads=threads,
            )
            result = run_in_subprocess(run, python=python)
            plain = plain or result
            identical = sum(a == b for a, b in zip(result.outputs, plain.outputs, strict=True))
            rows.append(VllmRow(entry.label, concurrency, result, identical))
    return rows


def vllm_table(rows: Sequence[VllmRow], categories: Sequence[str]) -> str:
    """Markdown: per concurrency and proposer, output tok/s, × no speculation, vLLM's mean
    acceptance length, latency p50, identical outputs; then per category (concurrency 1: each
    request's own time) the speed-up over no speculation."""
    lines = [
        "| concurrency | proposer | output tok/s | × none | mean acceptance length | latency p50 (s) | identical to "
        "none |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    base = {r.concurrency: r.result.tokens_per_second for r in rows if r.label == PLAIN}
    for r in rows:
        res = r.result
        ratio = res.tokens_per_second / base[r.concurrency] if base.get(r.concurrency) else 0.0
        lines.append(
            f"| {r.concurrency} | `{short_label(r.label)}` | {res.tokens_per_second:.1f} | {ratio:.2f}x | "
            f"{res.mean_acceptance_length:.2f} | {res.latency_p50:.2f} | {r.identical}/{len(res.outputs)} |"
        )
    singles = [r for r in rows if r.concurrency == 1 and len(r.result.latencies) == len(categories)]
    if singles:
        names = sorted(set(categories), key=list(categories).index)
        lines += [
            "",
            "Concurrency 1, speed-up over no speculation by category (tokens / summed request time):",
            "",
            "| proposer | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
        ]
        rates = {r.label: _category_rates(r.result, categories) for r in singles}
        for r in singles:
            cells = [
                f"{rates[r.label][c] / rates[PLAIN][c]:.2f}x" if rates.get(PLAIN, {}).get(c) else "–" for c in names
            ]
            lines.append(f"| `{short_label(r.label)}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _category_rates(result: VllmResult, categories: Sequence[str]) -> dict[str, float]:
    tokens: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for out, latency, category in zip(result.outputs, result.latencies, categories, strict=True):
        tokens[category] += len(out)
        seconds[category] += latency
    return {c: tokens[c] / seconds[c] for c in tokens if seconds[c] > 0}


def summary(rows: Sequence[VllmRow]) -> list[dict[str, Any]]:
    """The rows as plain data (results.json)."""
    return [
        {
            "label": r.label,
            "concurrency": r.concurrency,
            "tokens_per_second": r.result.tokens_per_second,
            "new_tokens": r.result.new_tokens,
            "seconds": r.result.seconds,
            "mean_acceptance_length": r.result.mean_acceptance_length,
            "latency_p50": r.result.latency_p50,
            "latency_mean": statistics.fmean(r.result.latencies) if r.result.latencies else 0.0,
            "identical": r.identical,
            "requests": len(r.result.outputs),
            "counters": r.result.counters,
            "latencies": r.result.latencies,
            "accepted": r.result.accepted,
            "spec_steps": r.result.spec_steps,
        }
        for r in rows
    ]
