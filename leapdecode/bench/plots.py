"""PNG plots a person would rather look at than read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from leapdecode.bench.labels import short_label  # noqa: E402
from leapdecode.bench.report import CATEGORY_TITLES, aggregate, categories_in, methods_in  # noqa: E402
from leapdecode.bench.runner import BASELINE, Sample  # noqa: E402


def speedup_by_category(samples: Sequence[Sample], path: Path, title: str) -> Path:
    """Speed-up of each method per category and overall, methods by their short labels."""
    aggs = aggregate(samples)
    cats = [*categories_in(samples), "overall"]
    methods = [m for m in methods_in(samples) if m != BASELINE]
    fig, ax = plt.subplots(figsize=(min(14.0, 3.0 + 1.3 * len(cats)), 4.8))
    width = 0.8 / max(1, len(methods))
    x = np.arange(len(cats))
    for i, method in enumerate(methods):
        values = [aggs[(method, c)].speedup if (method, c) in aggs else 0.0 for c in cats]
        bars = ax.bar(x + (i - (len(methods) - 1) / 2) * width, values, width, label=short_label(method))
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="plain decoding")
    ax.set_xticks(x, [CATEGORY_TITLES.get(c, c.title()) for c in cats])
    ax.set_ylabel("speed-up over plain decoding (x)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=min(3, len(methods) + 1), frameon=False)
    ax.set_ylim(0, max([1.2] + [aggs[(m, c)].speedup * 1.15 for m in methods for c in cats if (m, c) in aggs]))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def accepted_length_histogram(samples: Sequence[Sample], path: Path, title: str) -> Path:
    """Tokens emitted per target forward pass (accepted drafts + bonus), per drafting method."""
    methods = [
        m for m in methods_in(samples) if any(s.accepted_lengths and s.drafted_tokens for s in samples if s.method == m)
    ]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    counts = {m: Counter(n for s in samples if s.method == m for n in s.accepted_lengths) for m in methods}
    longest = max([1] + [max(c) for c in counts.values() if c])
    x = np.arange(1, longest + 1)
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        total = sum(counts[method].values()) or 1
        shares = [100 * counts[method][n] / total for n in x]
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, shares, width, label=short_label(method))
    ax.set_xticks(x)
    ax.set_xlabel("tokens emitted per forward pass (accepted drafts + bonus token)")
    ax.set_ylabel("% of forward passes")
    ax.set_title(title, fontsize=10)
    if methods:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_plots(
    grid: dict[tuple[int, int], float],
    path_heatmap: Path,
    path_lines: Path,
    title: str,
    labels: tuple[str, str] = ("N", "K"),
) -> tuple[Path, Path]:
    """Speed-up over a 2-D parameter grid: a heatmap, and one line per first parameter."""
    rows = sorted({a for a, _ in grid})
    cols = sorted({b for _, b in grid})
    values = np.array([[grid.get((a, b), np.nan) for b in cols] for a in rows])
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(cols), 1.2 + 0.6 * len(rows)))
    image = ax.imshow(values, cmap="viridis", aspect="auto", origin="lower")
    for i in range(len(rows)):
        for j in range(len(cols)):
            if not np.isnan(values[i, j]):
                ax.text(
                    j,
                    i,
                    f"{values[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if values[i, j] < np.nanmean(values) else "black",
                )
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(labels[1])
    ax.set_ylabel(labels[0])
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="speed-up (x)")
    fig.tight_layout()
    fig.savefig(path_heatmap, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, a in enumerate(rows):
        ax.plot(cols, values[i], marker="o", label=f"{labels[0]}={a}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel(labels[1])
    ax.set_ylabel("speed-up over plain decoding (x)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_lines, dpi=120)
    plt.close(fig)
    return path_heatmap, path_lines


def forward_cost_plot(results: dict[str, list], path: Path, title: str) -> Path:
    """Milliseconds per forward pass against tokens scored, one line per linear-layer kernel."""
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for label, costs in results.items():
        ax.plot([c.tokens for c in costs], [c.ms for c in costs], marker="o", label=label)
    ax.set_xlabel("tokens scored in one pass")
    ax.set_ylabel("ms per forward pass")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
