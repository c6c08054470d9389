"""The measuring commands beside `bench`: sweep (a method over a grid of its parameters), trace
(which drafts a generation accepted, step by step) and forward-cost (what a pass costs by size).

Each command imports the benchmark (and so torch) when it runs, not when the CLI starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markdown import Markdown

from leapdecode.cli.common import (
    DEFAULT_MODEL,
    BackendOpt,
    BenchThreadsOpt,
    ChatOpt,
    DatasetOpt,
    DtypeOpt,
    LimitOpt,
    MaxNewOpt,
    MethodOpt,
    ModelOpt,
    OutOpt,
    PromptArg,
    QuantizeOpt,
    RowExactOpt,
    console,
    friendly,
    load_with_progress,
    read_prompt,
)
from leapdecode.errors import InputError, MethodError


@friendly
def sweep(
    model: ModelOpt = DEFAULT_MODEL,
    method: MethodOpt = "anpd",
    grid: Annotated[str, typer.Option("--grid", help="Parameters to sweep, e.g. 'n=2..6 k=1..10'.")] = "n=2..6 k=1..10",
    dataset: DatasetOpt = "humaneval",
    limit: LimitOpt = "5",
    max_new_tokens: MaxNewOpt = 128,
    out: OutOpt = Path("out/sweep"),
    threads: BenchThreadsOpt = 0,
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = "auto",
    backend: BackendOpt = "torch",
) -> None:
    """Speed-up of one method over a grid of its parameters (the ANPD paper's Figures 3-5), on
    the model as `--dtype`, `--quantize` and `--backend` load it (plain decoding on the same)."""
    from leapdecode.bench import plots, report
    from leapdecode.bench.datasets import load_dataset
    from leapdecode.bench.harness import parse_grid, run_meta, run_with_progress, use_threads
    from leapdecode.methods import parse_method

    base = parse_method(method)
    axes = parse_grid(grid)
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(axes) - fields
    if unknown:
        raise MethodError(
            f"{base.name} has no parameter {', '.join(sorted(unknown))}; it has: {', '.join(sorted(fields)) or 'none'}"
        )
    names = list(axes)
    points = [(a, b) for a in axes[names[0]] for b in (axes[names[1]] if len(names) == 2 else [0])]
    variants = {
        p: dataclasses.replace(base, **{names[0]: p[0], **({names[1]: p[1]} if len(names) == 2 else {})})
        for p in points
    }
    prompts = load_dataset(dataset, limit)
    n_threads = use_threads(threads)
    lm = load_with_progress(model, backend=backend, dtype=dtype, quantize=quantize if backend == "torch" else "none")
    samples = run_with_progress(console, lm, list(variants.values()), prompts, max_new_tokens)
    meta = run_meta(lm.name, dataset, limit, max_new_tokens, n_threads, len(prompts), lm.describe)
    report.write_outputs(out, samples, meta, {str(m): m.draft_length for m in variants.values()})
    aggs = report.aggregate(samples)
    speedups = {p: aggs[(str(m), "overall")].speedup for p, m in variants.items()}
    taus = {p: aggs[(str(m), "overall")].stats.tau for p, m in variants.items()}
    row_name, col_name = names[0], (names[1] if len(names) == 2 else "-")
    cols = sorted({b for _, b in points})
    over = f"{row_name} × {col_name}" if len(names) == 2 else row_name
    header = " | ".join(str(c) for c in cols) if len(names) == 2 else "speed-up (τ)"
    lines = [
        f"Speed-up (τ) of `{base.name}` over {over}: {meta['prompts']} prompts of {dataset}, "
        f"{max_new_tokens} new tokens, {lm.name} ({lm.describe}), {meta['machine']}.",
        "",
        "| " + (row_name + " \\ " + col_name if len(names) == 2 else row_name) + " | " + header + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for a in sorted({a for a, _ in points}):
        lines.append(f"| {a} | " + " | ".join(f"{speedups[(a, c)]:.2f}x ({taus[(a, c)]:.2f})" for c in cols) + " |")
    best = max(speedups, key=speedups.get)
    lines += ["", f"Best: `{variants[best]}` at {speedups[best]:.2f}x.", "", report.mismatch_report(samples)]
    (out / "sweep.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "sweep.json").write_text(
        json.dumps([{**dict(zip(names, p)), "speedup": speedups[p], "tau": taus[p]} for p in points], indent=2)
    )
    title = f"{base.name} on {lm.name}: speed-up over {row_name} x {col_name} ({meta['prompts']} prompts)"
    plots.sweep_plots(speedups, out / "sweep_heatmap.png", out / "sweep_lines.png", title, (row_name, col_name))
    console.print(Markdown("\n".join(lines)))
    console.print(f"wrote {out}/sweep.md, sweep.json, sweep_heatmap.png, sweep_lines.png, samples.jsonl")


@friendly
def trace(
    prompt: PromptArg = None,
    model: ModelOpt = DEFAULT_MODEL,
    method: MethodOpt = "anpd",
    max_new_tokens: MaxNewOpt = 128,
    chat: ChatOpt = False,
    out: Annotated[Path | None, typer.Option("--out", help="Write a self-contained HTML page here.")] = None,
    show_rejected: Annotated[bool, typer.Option("--rejected/--no-rejected", help="Show rejected drafts.")] = True,
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = "auto",
) -> None:
    """Show step by step which drafted tokens were accepted, rejected, and the bonus tokens."""
    from leapdecode.api import wrap
    from leapdecode.bench.trace import render_html, render_terminal, trace_steps
    from leapdecode.methods import parse_method

    text = read_prompt(prompt)
    parse_method(method)
    decoder = wrap(load_with_progress(model, dtype=dtype, quantize=quantize), method)
    result = decoder.generate(text, max_new_tokens=max_new_tokens, chat=chat)
    steps = trace_steps(result, decoder.lm.tokenizer)
    console.print(render_terminal(steps, show_rejected))
    console.print(
        "legend: [black on green3]accepted draft[/] [black on yellow]bonus token[/] [red strike]rejected draft[/] │ = "
        "one forward pass"
    )
    console.print(f"[dim]{result.method} | {result.stats.summary()}[/]")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(result, steps, decoder.lm.name, text), encoding="utf-8")
        console.print(f"wrote {out}")


@friendly
def forward_cost(
    model: ModelOpt = DEFAULT_MODEL,
    tokens: Annotated[
        str, typer.Option("--tokens", help="Comma list of token counts to score in one pass.")
    ] = "1,2,4,8,12,16,24,32,48,64",
    context: Annotated[int, typer.Option("--context", help="Cached context length before each pass.")] = 300,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed passes per size (median).")] = 5,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write the table (markdown) and a plot here (folder).")
    ] = None,
    threads: BenchThreadsOpt = 0,
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "torch",
    row_exact: RowExactOpt = None,
    quantize: QuantizeOpt = "auto",
    layers: Annotated[
        bool,
        typer.Option(
            "--layers",
            help="Also time each kind of quantized layer alone at every size, beside the whole pass: "
            "where a pass goes (ms, G multiply-adds a second, GB/s).",
        ),
    ] = False,
) -> None:
    """Time one forward pass against the number of tokens it scores (draft and tree sizes)."""
    from leapdecode.bench import plots
    from leapdecode.bench.forward_cost import compare, markdown
    from leapdecode.bench.harness import machine_description, use_threads
    from leapdecode.bench.layer_cost import layers_markdown, measure_layers

    try:
        sizes = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise InputError(f"--tokens must be a comma list of integers, got {tokens!r}") from None
    if not sizes or min(sizes) < 1 or max(sizes) > 512 or context < 1 or repeats < 1:
        raise InputError("--tokens must be between 1 and 512, --context and --repeats at least 1")
    sizes = sorted(set(sizes) | {1})
    n_threads = use_threads(threads)
    lm = load_with_progress(model, backend=backend, dtype=dtype, row_exact=row_exact, quantize=quantize)
    if layers and (lm.backend != "torch" or lm.quantize == "none"):
        raise InputError(f"--layers times quantized layers; {lm.name} runs {lm.describe}")
    results = compare(lm, sizes, context, repeats)
    what = f"`{lm.name}` ({lm.describe})"
    machine = machine_description(n_threads)
    table = markdown(
        results, f"One forward pass of {what} after {context} cached tokens, median of {repeats}; {machine}."
    )
    console.print(Markdown(table))
    split = None
    if layers:
        split = layers_markdown(
            measure_layers(lm.model, sizes, repeats),
            next(iter(results.values())),  # `compare` gives the chain as loaded first
            f"Where a pass of {what} goes: each kind of the model's quantized layers alone, ms (GB/s at one "
            f"row, then G multiply-adds a second), median of {repeats}; the rest also holds what the lean "
            f"forward's fused layers and single call save; {machine}.",
        )
        console.print(Markdown(split))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "forward_cost.md").write_text(table + "\n", encoding="utf-8")
        if split is not None:
            (out / "layers.md").write_text(split + "\n", encoding="utf-8")
        plots.forward_cost_plot(results, out / "forward_cost.png", f"{lm.name}: one forward pass vs tokens scored")
        console.print(f"wrote {out}/forward_cost.md, {'layers.md, ' if split else ''}forward_cost.png")


def register(app: typer.Typer) -> None:
    app.command()(sweep)
    app.command()(trace)
    app.command("forward-cost")(forward_cost)
