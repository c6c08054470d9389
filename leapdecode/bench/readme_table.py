"""The README's results table: a run's overall and per-category speed-ups, in a compact table
written between two markers of a README (`bench report --readme`), so the front page's figures
always come from one run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from leapdecode.bench.labels import is_peer, run_backend, short_label
from leapdecode.bench.report import (
    CATEGORY_TITLES,
    aggregate,
    categories_in,
    lossless_failures,
    methods_in,
    peer_differences,
)
from leapdecode.bench.runner import BASELINE, Sample


def readme_table(samples: Sequence[Sample], meta: dict[str, object]) -> str:
    """A compact table for the README: overall and per-category speed-up of each method."""
    aggs = aggregate(samples)
    cats = categories_in(samples)
    backend = run_backend(meta)
    head = ["Method", *(CATEGORY_TITLES.get(c, c) for c in cats), "Overall", "τ", "tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    for method in methods_in(samples):
        o = aggs[(method, "overall")]
        cells = [f"{aggs[(method, c)].speedup:.2f}x" if (method, c) in aggs else "–" for c in cats]
        row = [
            f"`{short_label(method, backend)}`",
            *cells,
            f"**{o.speedup:.2f}x**",
            f"{o.stats.tau:.2f}",
            f"{o.stats.tokens_per_s:.1f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    checked = sum(1 for s in samples if s.equal_to_plain is not None and s.lossless and not is_peer(s.method))
    bad = len(lossless_failures(samples))
    peers = len(peer_differences(samples))
    note = (
        f"\n\n`{meta.get('model')}`, {meta.get('prompts')} prompts ({meta.get('dataset')}, limit {meta.get('limit')}), "
        f"{meta.get('max_new_tokens')} new tokens, {meta.get('decoding', 'greedy')}, one run on {meta.get('machine')}. "
        "Speed-up against this "
        f"project's plain decoding (`{short_label(BASELINE, backend)}`) in the same run; lossless check: "
        + (
            f"all {checked} samples identical to plain decoding."
            if not bad
            else f"**{bad} of {checked} samples differ**."
        )
        + (f" Peers differ from plain decoding on {peers} samples (their own libraries' arithmetic)." if peers else "")
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
