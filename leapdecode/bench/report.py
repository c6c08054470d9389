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
from leapdecode.bench.runner import BASELINE, Sample
from leapdecode.engine import GenerationStats

CATEGORY_TITLES = {
    "multi-turn": "MT-Bench", "translation": "Translation", "summarization": "Summarization", "qa": "QA",
    "math_reasoning": "Math", "rag": "RAG", "humaneval": "HumanEval",
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
                method=method, category=category, prompts=len(group), stats=pooled,
                plain_wall_time_s=sum(plain_time[(s.prompt_id, s.category)] for s in group),
                mismatches=sum(1 for s in group if s.equal_to_plain is False),
                peak_memory_mb=max(s.peak_memory_mb for s in group),
                agreement=_pooled_agreement(group),
                speedup_range=_speedup_range(group, plain_runs),
            )
    return out


def _speedup_range(group: Sequence[Sample], plain_runs: dict[tuple[str, str], list[float]]) -> tuple[float, float] | None:
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
    """Samples whose output differs from plain decoding (a bug for a lossless method)."""
    return [s for s in samples if s.equal_to_plain is False]


def markdown_table(samples: Sequence[Sample], draft_lengths: dict[str, int] | None = None) -> str:
    """Spec-Bench's layout: one column per category (speed-up and tau), then overall figures."""
    aggs = aggregate(samples)
    cats = categories_in(samples)
    head = ["Method", *(CATEGORY_TITLES.get(c, c) for c in cats), "Overall speed-up", "τ", "α", "α·K+1", "tok/s", "peak MB", "identical", "agreement"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    for method in methods_in(samples):
        row = [f"`{method}`"]
        for c in cats:
            a = aggs.get((method, c))
            row.append(f"{a.speedup:.2f}x (τ {a.stats.tau:.2f})" if a else "–")
        o = aggs[(method, "overall")]
        k = (draft_lengths or {}).get(method, 0)
        bound = f"{o.stats.speedup_bound(k):.2f}" if k and o.stats.drafted_tokens else "–"
        alpha = f"{o.stats.alpha:.2f}" if o.stats.drafted_tokens else "–"
        same = "–" if method == BASELINE else ("all" if o.mismatches == 0 else f"**{o.prompts - o.mismatches}/{o.prompts}**")
        memory = f"{o.peak_memory_mb:,.0f}" if o.peak_memory_mb else "–"
        agreed = f"{o.agreement:.3f}" if o.agreement is not None else "–"
        spread = f" ({o.speedup_range[0]:.2f}–{o.speedup_range[1]:.2f})" if o.speedup_range else ""
        row += [f"**{o.speedup:.2f}x**{spread}", f"{o.stats.tau:.2f}", alpha, bound, f"{o.stats.tokens_per_s:.1f}", memory, same, agreed]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def variants_with_own_plain(samples: Sequence[Sample]) -> list[str]:
    """The model variants of a run (`X` in `anpd@X`) that have their own plain decoding (`ar@X`)."""
    return [m.partition("@")[2] for m in methods_in(samples) if m.startswith(f"{BASELINE}@")]


def on_variant(samples: Sequence[Sample], variant: str) -> list[Sample]:
    """One variant's samples relabelled so that its own plain decoding (`ar@X`) is the baseline:
    `anpd@bfloat16` against `ar@bfloat16`, where the main table has it against the run's `ar`."""
    suffix = f"@{variant}"
    return [
        dataclasses.replace(s, method=s.method.removesuffix(suffix), equal_to_plain=None if s.method == BASELINE + suffix else s.equal_to_plain)
        for s in samples if s.method.endswith(suffix)
    ]


def mismatch_report(samples: Sequence[Sample]) -> str:
    bad = mismatches(samples)
    checked = sum(1 for s in samples if s.equal_to_plain is not None)
    if not bad:
        return f"Lossless check: all {checked} samples equal plain decoding token for token."
    lines = [
        f"**Lossless check FAILED: {len(bad)} of {checked} samples differ from plain decoding.**", "",
        "| method | prompt | category | first differing position | lossless method |", "|---|---|---|---:|---|",
    ]
    for s in bad:
        lines.append(f"| `{s.method}` | {s.prompt_id} | {s.category} | {s.first_difference} | {'yes (a bug)' if s.lossless else 'no'} |")
    return "\n".join(lines)


def write_outputs(out_dir: Path, samples: Sequence[Sample], meta: dict[str, object], draft_lengths: dict[str, int]) -> dict[str, Path]:
    """samples.jsonl, summary.json and results.md in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"samples": out_dir / "samples.jsonl", "summary": out_dir / "summary.json", "table": out_dir / "results.md"}
    with open(paths["samples"], "w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s.to_dict()) + "\n")
    summary = {
        "meta": meta,
        "results": _summary_rows(samples),
        # per variant X with `ar@X`: its methods against `ar@X` (names without the @X)
        "against_own_plain": {v: _summary_rows(on_variant(samples, v)) for v in variants_with_own_plain(samples)},
    }
    paths["summary"].write_text(json.dumps(summary, indent=2), encoding="utf-8")
    header = (
        f"Model `{meta.get('model')}`{' (' + str(meta['weights']) + ')' if meta.get('weights') else ''}, "
        f"{meta.get('max_new_tokens')} new tokens, greedy, batch 1, "
        f"{meta.get('threads')} threads, {meta.get('prompts')} prompts ({meta.get('dataset')}, "
        f"limit {meta.get('limit')} per category); machine: {meta.get('machine')}.\n"
        "Speed-up = total time of plain decoding (`ar`) / total time of the method, same prompts, same run. "
        "τ = new tokens / target forward passes; α = accepted / drafted tokens; peak MB = parameters of the "
        "models a method runs + the growth of resident memory during an untimed run on the longest prompt; "
        "with repeats, times are medians and the overall speed-up shows the lowest and highest repeat; "
        "agreement (lossy methods only) = share of generated tokens equal to the full model's greedy token "
        "after the same prefix.\n"
    )
    sections = [header, markdown_table(samples, draft_lengths)]
    for variant in variants_with_own_plain(samples):
        suffix = f"@{variant}"
        own = {m.removesuffix(suffix): k for m, k in (draft_lengths or {}).items() if m.endswith(suffix)}
        sections += [f"Against plain decoding on the same model, `{BASELINE}{suffix}`:", markdown_table(on_variant(samples, variant), own)]
    sections.append(mismatch_report(samples))
    paths["table"].write_text("\n\n".join(sections) + "\n", encoding="utf-8")
    return paths


def _summary_rows(samples: Sequence[Sample]) -> list[dict[str, object]]:
    return [
        {
            "method": a.method, "category": a.category, "prompts": a.prompts, "speedup": a.speedup,
            "tau": a.stats.tau, "alpha": a.stats.alpha, "tokens_per_s": a.stats.tokens_per_s,
            "new_tokens": a.stats.new_tokens, "wall_time_s": a.stats.wall_time_s, "mismatches": a.mismatches,
            "peak_memory_mb": a.peak_memory_mb, "agreement": a.agreement,
        }
        for a in aggregate(samples).values()
    ]


def read_samples(path: Path) -> list[Sample]:
    with open(path, encoding="utf-8") as fh:
        return [Sample(**json.loads(line)) for line in fh if line.strip()]


def readme_table(samples: Sequence[Sample], meta: dict[str, object]) -> str:
    """A compact table for the README: overall and per-category speed-up of each method."""
    aggs = aggregate(samples)
    cats = categories_in(samples)
    head = ["Method", *(CATEGORY_TITLES.get(c, c) for c in cats), "Overall", "τ", "tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    for method in methods_in(samples):
        o = aggs[(method, "overall")]
        cells = [f"{aggs[(method, c)].speedup:.2f}x" if (method, c) in aggs else "–" for c in cats]
        lines.append("| " + " | ".join([f"`{method}`", *cells, f"**{o.speedup:.2f}x**", f"{o.stats.tau:.2f}", f"{o.stats.tokens_per_s:.1f}"]) + " |")
    checked = sum(1 for s in samples if s.equal_to_plain is not None)
    bad = len(mismatches(samples))
    note = (
        f"\n\n`{meta.get('model')}`, {meta.get('prompts')} prompts ({meta.get('dataset')}, limit {meta.get('limit')}), "
        f"{meta.get('max_new_tokens')} new tokens, greedy, one run on {meta.get('machine')}. Speed-up against this "
        f"project's plain decoding (`ar`) in the same run; lossless check: "
        + (f"all {checked} samples identical to plain decoding." if not bad else f"**{bad} of {checked} samples differ**.")
    )
    return "\n".join(lines) + note


def update_readme(readme: Path, table: str, marker: str = "<!-- results-table -->") -> None:
    """Replace what lies between the two markers (or after the single marker) with `table`."""
    text = readme.read_text(encoding="utf-8")
    if marker not in text:
        raise ValueError(f"{readme} has no {marker} marker")
    head, _, rest = text.partition(marker)
    _, found, tail = rest.partition(marker)
    tail = tail if found else rest
    readme.write_text(f"{head}{marker}\n{table}\n{marker}{tail}", encoding="utf-8")
