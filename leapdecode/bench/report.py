"""Benchmark arithmetic and reports: speed-up, tau and alpha per category, Spec-Bench-style tables.

Speed-up of a method on a set of prompts = total wall time of plain decoding / total wall time
of the method, over the same prompts (Spec-Bench's and ANPD's definition): a ratio of sums,
not a mean of ratios.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from leapdecode.bench.datasets import SPEC_BENCH_CATEGORIES
from leapdecode.bench.labels import LLAMACPP_PLAIN, is_peer, method_of, run_backend, short_label, variant_backend
from leapdecode.bench.runner import BASELINE, Sample
from leapdecode.engine import GenerationStats

CATEGORY_TITLES = {
    "multi-turn": "MT-Bench",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
    "humaneval": "HumanEval",
}


@dataclass(frozen=True)
class Aggregate:
    """A method's pooled statistics over a set of prompts, beside plain decoding's time on them."""

    method: str
    category: str  # a category, or "overall"
    prompts: int
    stats: GenerationStats  # pooled: tau, alpha and tokens/s over all the prompts together
    plain_wall_time_s: float
    mismatches: int
    peak_memory_mb: float = 0.0  # the largest over the group's samples
    agreement: float | None = None  # lossy methods: token-weighted agreement with the full model
    speedup_range: tuple[float, float] | None = None  # with repeats: lowest and highest speed-up of one repeat

    @property
    def speedup(self) -> float:
        return self.plain_wall_time_s / self.stats.wall_time_s if self.stats.wall_time_s > 0 else 0.0


def categories_in(samples: Iterable[Sample]) -> list[str]:
    present = {s.category for s in samples}
    known = [c for c in (*SPEC_BENCH_CATEGORIES, "humaneval") if c in present]
    return known + sorted(present - set(known))


def methods_in(samples: Iterable[Sample]) -> list[str]:
    seen: dict[str, None] = {}
    for s in samples:
        seen.setdefault(s.method, None)
    return list(seen)


def aggregate(samples: Sequence[Sample]) -> dict[tuple[str, str], Aggregate]:
    """Per (method, category) and per (method, "overall"), against plain decoding on the same prompts."""
    plain_time = {(s.prompt_id, s.category): s.wall_time_s for s in samples if s.method == BASELINE}
    plain_runs = {(s.prompt_id, s.category): s.wall_time_runs for s in samples if s.method == BASELINE}
    out: dict[tuple[str, str], Aggregate] = {}
    for method in methods_in(samples):
        mine = [s for s in samples if s.method == method]
        for category in [*categories_in(mine), "overall"]:
            group = [s for s in mine if category in ("overall", s.category)]
            pooled = GenerationStats(
                new_tokens=sum(s.new_tokens for s in group),
                forward_passes=sum(s.forward_passes for s in group),
                drafted_tokens=sum(s.drafted_tokens for s in group),
                accepted_tokens=sum(s.accepted_tokens for s in group),
                wall_time_s=sum(s.wall_time_s for s in group),
                accepted_lengths=(),
            )
            out[(method, category)] = Aggregate(
                method=method,
                category=category,
                prompts=len(group),
                stats=pooled,
                plain_wall_time_s=sum(plain_time[(s.prompt_id, s.category)] for s in group),
                mismatches=sum(1 for s in group if s.equal_to_plain is False),
                peak_memory_mb=max(s.peak_memory_mb for s in group),
                agreement=_pooled_agreement(group),
                speedup_range=_speedup_range(group, plain_runs),
            )
    return out


def _speedup_range(
    group: Sequence[Sample], plain_runs: dict[tuple[str, str], list[float]]
) -> tuple[float, float] | None:
    """Speed-up of each repeat (its runs summed over the group), lowest and highest; None for one repeat."""
    repeats = min((len(s.wall_time_runs) for s in group), default=0)
    if repeats < 2 or any(len(plain_runs.get((s.prompt_id, s.category), [])) < repeats for s in group):
        return None
    ratios = [
        sum(plain_runs[(s.prompt_id, s.category)][r] for s in group) / sum(s.wall_time_runs[r] for s in group)
        for r in range(repeats)
    ]
    return min(ratios), max(ratios)


def _pooled_agreement(group: Sequence[Sample]) -> float | None:
    scored = [s for s in group if s.agreement is not None]
    tokens = sum(s.new_tokens for s in scored)
    if not scored or tokens == 0:
        return None
    return sum(s.agreement * s.new_tokens for s in scored if s.agreement is not None) / tokens


def mismatches(samples: Sequence[Sample]) -> list[Sample]:
    """Samples of this engine's methods whose output differs from plain decoding: a bug for a
    lossless method, by design for a lossy one. A peer's differences are its own library's
    arithmetic (`peer_differences`), not this engine's."""
    return [s for s in samples if s.equal_to_plain is False and not is_peer(s.method)]


def lossless_failures(samples: Sequence[Sample]) -> list[Sample]:
    """Samples of a lossless method of this engine that differ from plain decoding: each one a bug."""
    return [s for s in mismatches(samples) if s.lossless]


def peer_differences(samples: Sequence[Sample]) -> list[Sample]:
    """Samples of a peer whose output differs from this engine's plain decoding: the peer computes
    the same model with other kernels (another order of sums), so greedy ties may break otherwise."""
    return [s for s in samples if s.equal_to_plain is False and is_peer(s.method)]


def markdown_table(
    samples: Sequence[Sample], draft_lengths: dict[str, int] | None = None, backend: str = "torch"
) -> str:
    """Spec-Bench's layout: one column per category (speed-up and tau), then overall figures;
    methods by `short_label` on a run whose own model runs on `backend`."""
    aggs = aggregate(samples)
    cats = categories_in(samples)
    head = [
        "Method",
        *(CATEGORY_TITLES.get(c, c) for c in cats),
        "Overall speed-up",
        "τ",
        "α",
        "α·K+1",
        "tok/s",
        "peak MB",
        "identical",
        "agreement",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    for method in methods_in(samples):
        row = [f"`{short_label(method, backend)}`"]
        for c in cats:
            a = aggs.get((method, c))
            row.append(f"{a.speedup:.2f}x (τ {a.stats.tau:.2f})" if a else "–")
        o = aggs[(method, "overall")]
        k = (draft_lengths or {}).get(method, 0)
        bound = f"{o.stats.speedup_bound(k):.2f}" if k and o.stats.drafted_tokens else "–"
        alpha = f"{o.stats.alpha:.2f}" if o.stats.drafted_tokens else "–"
        same = _identical(method, o)
        memory = f"{o.peak_memory_mb:,.0f}" if o.peak_memory_mb else "–"
        agreed = f"{o.agreement:.3f}" if o.agreement is not None else "–"
        spread = f" ({o.speedup_range[0]:.2f}–{o.speedup_range[1]:.2f})" if o.speedup_range else ""
        row += [
            f"**{o.speedup:.2f}x**{spread}",
            f"{o.stats.tau:.2f}",
            alpha,
            bound,
            f"{o.stats.tokens_per_s:.1f}",
            memory,
            same,
            agreed,
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _identical(method: str, o: Aggregate) -> str:
    """The identical column: bold where a difference is a lossless failure of this engine."""
    if method == BASELINE:
        return "–"
    if o.mismatches == 0:
        return "all"
    parsed = method_of(method)
    failure = parsed is None or (parsed.capabilities.lossless and not parsed.capabilities.peer)
    count = f"{o.prompts - o.mismatches}/{o.prompts}"
    return f"**{count}**" if failure else count


def variants_with_own_plain(samples: Sequence[Sample]) -> list[str]:
    """The model variants of a run (`X` in `anpd@X`) that have their own plain decoding (`ar@X`)."""
    return [m.partition("@")[2] for m in methods_in(samples) if m.startswith(f"{BASELINE}@")]


def on_variant(samples: Sequence[Sample], variant: str) -> list[Sample]:
    """One variant's samples relabelled so that its own plain decoding (`ar@X`) is the baseline:
    `anpd@bfloat16` against `ar@bfloat16`, where the main table has it against the run's `ar`."""
    suffix = f"@{variant}"
    return [
        dataclasses.replace(
            s,
            method=s.method.removesuffix(suffix),
            equal_to_plain=None if s.method == BASELINE + suffix else s.equal_to_plain,
        )
        for s in samples
        if s.method.endswith(suffix)
    ]


def mismatch_report(samples: Sequence[Sample], backend: str = "torch") -> str:
    """The lossless check: every sample of this engine's lossless methods equals plain decoding
    token for token, or the check fails. Peers that differ are listed apart (their library's
    numerics, not a failure); lossy methods are counted, their agreement is in the table."""
    checked = [s for s in samples if s.equal_to_plain is not None]
    ours = [s for s in checked if s.lossless and not is_peer(s.method)]
    bad = lossless_failures(checked)
    if bad:
        lines = [
            f"**Lossless check FAILED: {len(bad)} of {len(ours)} samples differ from plain decoding.**",
            "",
            *_difference_rows(bad, backend),
        ]
    else:
        lines = [f"Lossless check: all {len(ours)} samples equal plain decoding token for token."]
    peers = [s for s in checked if is_peer(s.method)]
    differ = peer_differences(checked)
    if differ:
        lines += [
            "",
            f"Peers that differ from plain decoding: {len(differ)} of {len(peers)} samples. A peer computes the model "
            "with its own library's kernels, so a near tie may go the other way: the peer's difference, not a lossless "
            "failure.",
            "",
            *_difference_rows(differ, backend),
        ]
    elif peers:
        lines += ["", f"Peers: all {len(peers)} samples equal plain decoding."]
    lossy = [s for s in checked if not s.lossless and not is_peer(s.method)]
    if lossy:
        lines += [
            "",
            f"Lossy methods: {sum(s.equal_to_plain is False for s in lossy)} of {len(lossy)} samples differ from plain "
            f"decoding (by design; see agreement).",
        ]
    return "\n".join(lines)


def _difference_rows(samples: Sequence[Sample], backend: str) -> list[str]:
    rows = ["| method | prompt | category | first differing position |", "|---|---|---|---:|"]
    return rows + [
        f"| `{short_label(s.method, backend)}` | {s.prompt_id} | {s.category} | {s.first_difference} |" for s in samples
    ]


def write_outputs(
    out_dir: Path, samples: Sequence[Sample], meta: dict[str, object], draft_lengths: dict[str, int]
) -> dict[str, Path]:
    """samples.jsonl, summary.json and results.md in `out_dir`; methods by their full strings in
    the data (`method`), by `short_label` in the table and in summary.json's `label`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"samples": out_dir / "samples.jsonl", "summary": out_dir / "summary.json", "table": out_dir / "results.md"}
    with open(paths["samples"], "w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s.to_dict()) + "\n")
    backend = run_backend(meta)
    variants = variants_with_own_plain(samples)
    summary = {
        "meta": meta,
        "results": _summary_rows(samples, backend),
        # per variant X with `ar@X`: its methods against `ar@X` (names without the @X)
        "against_own_plain": {v: _summary_rows(on_variant(samples, v), variant_backend(v)) for v in variants},
    }
    paths["summary"].write_text(json.dumps(summary, indent=2), encoding="utf-8")
    sections = [results_header(meta, samples), markdown_table(samples, draft_lengths, backend)]
    for variant in variants:
        suffix = f"@{variant}"
        own = {m.removesuffix(suffix): k for m, k in (draft_lengths or {}).items() if m.endswith(suffix)}
        sections += [
            f"Against plain decoding on the same model, `{short_label(BASELINE + suffix, backend)}`:",
            markdown_table(on_variant(samples, variant), own, variant_backend(variant)),
        ]
    sections.append(mismatch_report(samples, backend))
    paths["table"].write_text("\n\n".join(sections) + "\n", encoding="utf-8")
    return paths


def provenance(meta: dict[str, object]) -> str:
    """When and from what a run came (`Run 2025-01-02T03:04:05+00:00, leapdecode 0.1.0, commit
    abc1234.`), from the fields its meta has: a run recorded before they were kept says nothing."""
    parts = [
        f"{prefix}{meta[key]}"
        for key, prefix in (("date", "run "), ("version", "leapdecode "), ("commit", "commit "))
        if meta.get(key)
    ]
    if not parts:
        return ""
    text = ", ".join(parts)
    return f"{text[0].upper()}{text[1:]}."


def results_header(meta: dict[str, object], samples: Sequence[Sample]) -> str:
    """What ran, where, when, and how to read the table."""
    backend = run_backend(meta)
    baseline = short_label(BASELINE, backend)
    labels = {short_label(m, backend) for m in methods_in(samples)}
    weights = f" ({meta['weights']})" if meta.get("weights") else ""
    text = (
        f"Model `{meta.get('model')}`{weights}, {meta.get('max_new_tokens')} new tokens, "
        f"{meta.get('decoding', 'greedy')}, batch 1, "
        f"{meta.get('threads')} threads, {meta.get('prompts')} prompts ({meta.get('dataset')}, "
        f"limit {meta.get('limit')} per category); machine: {meta.get('machine')}. {provenance(meta)}\n"
        f"Speed-up = total time of plain decoding (`{baseline}`) / total time of the method, same prompts, same run. "
        "Methods are named by the parameters they set away from their defaults (`leapdecode methods` lists them). "
        "τ = new tokens / target forward passes; α = accepted / drafted tokens; peak MB = parameters of the "
        "models a method runs + the growth of resident memory during an untimed run on the longest prompt; "
        "with repeats, times are medians and the overall speed-up shows the lowest and highest repeat; "
        "agreement (lossy methods only) = share of generated tokens equal to the full model's greedy token "
        "after the same prefix.\n"
    )
    heads = meta.get("heads")
    if isinstance(heads, dict) and heads:
        text += "Trained heads: " + "; ".join(f"{labels}: {about}" for labels, about in heads.items()) + ".\n"
    if LLAMACPP_PLAIN in labels:
        text += (
            f"`{LLAMACPP_PLAIN}` = this engine's plain decoding with llama.cpp computing each forward pass; "
            "`llama-cpp` = llama-cpp-python's own generator (a peer); `ar` = this engine's plain decoding on PyTorch.\n"
        )
    return text


def _summary_rows(samples: Sequence[Sample], backend: str = "torch") -> list[dict[str, object]]:
    return [
        {
            "method": a.method,
            "label": short_label(a.method, backend),
            "category": a.category,
            "prompts": a.prompts,
            "speedup": a.speedup,
            "tau": a.stats.tau,
            "alpha": a.stats.alpha,
            "tokens_per_s": a.stats.tokens_per_s,
            "new_tokens": a.stats.new_tokens,
            "wall_time_s": a.stats.wall_time_s,
            "mismatches": a.mismatches,
            "peak_memory_mb": a.peak_memory_mb,
            "agreement": a.agreement,
        }
        for a in aggregate(samples).values()
    ]


def read_samples(path: Path) -> list[Sample]:
    with open(path, encoding="utf-8") as fh:
        return [Sample(**json.loads(line)) for line in fh if line.strip()]
