"""`leapdecode bench`, `leapdecode sweep` and `leapdecode trace`, registered on the main app."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from collections import defaultdict
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from leapdecode.bench import plots, report
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import BASELINE, Entry, Sample, parse_entries, run_benchmark
from leapdecode.cli import DEFAULT_MODEL, BackendOpt, ChatOpt, MaxNewOpt, MethodOpt, ModelOpt, PromptArg, load_with_progress, read_prompt, set_threads, app, console, friendly
from leapdecode.errors import InputError, MethodError
from leapdecode.methods import Method, parse_method

DEFAULT_METHODS = "ar,anpd:n=5,k=7,pld,hf,hf-pld:tokens=10"
DatasetOpt = Annotated[str, typer.Option("--dataset", "-d", help="humaneval, spec-bench, spec-bench:CATEGORY, a JSONL file; join with +.")]
LimitOpt = Annotated[str, typer.Option("--limit", help="Prompts per category: N, or N,CATEGORY=M,... (e.g. 10,humaneval=30).")]
OutOpt = Annotated[Path, typer.Option("--out", help="Output folder.")]
BenchThreadsOpt = Annotated[int, typer.Option("--threads", help="Torch CPU threads for every method (0: all cores).")]


def machine_description(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {device}, torch {torch.__version__}, {threads} threads"


def _threads(threads: int) -> int:
    set_threads(threads or (os.cpu_count() or 1))
    return torch.get_num_threads()


def _run_with_progress(lm, methods: list[Method] | list[Entry], prompts, max_new_tokens: int, load_backend=None) -> list[Sample]:
    times: dict[str, float] = defaultdict(float)
    total = len(prompts) * (1 + sum(1 for m in methods if (m.label if isinstance(m, Entry) else str(m)) != BASELINE))
    with Progress(
        TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[live]}"), console=console,
    ) as progress:
        task = progress.add_task("bench", total=total, live="warming up")

        def on_sample(sample: Sample) -> None:
            times[sample.method] += sample.wall_time_s
            plain = times[BASELINE]
            live = "  ".join(f"{m} {plain / t:.2f}x" for m, t in times.items() if m != BASELINE and t > 0)
            progress.update(task, advance=1, live=live or "plain decoding")

        return run_benchmark(
            lm, methods, prompts, max_new_tokens, on_sample=on_sample, log=console.log, load_backend=load_backend,
        )


def _meta(model: str, dataset: str, limit: str, max_new_tokens: int, threads: int, n_prompts: int) -> dict[str, object]:
    return {
        "model": model, "dataset": dataset, "limit": limit, "max_new_tokens": max_new_tokens, "threads": threads,
        "prompts": n_prompts, "machine": machine_description(threads),
    }


@app.command()
@friendly
def bench(
    model: ModelOpt = DEFAULT_MODEL,
    methods: Annotated[str, typer.Option("--methods", help="Comma list of method strings; `ar` always runs first.")] = DEFAULT_METHODS,
    dataset: DatasetOpt = "humaneval+spec-bench",
    limit: LimitOpt = "10",
    max_new_tokens: MaxNewOpt = 128,
    out: OutOpt = Path("out/bench"),
    threads: BenchThreadsOpt = 0,
    plot: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots.")] = True,
    backend: BackendOpt = "torch",
) -> None:
    """Run methods and peers side by side (interleaved, one run) and write tables and plots.
    `--backend` runs the model (and `ar`, the baseline) on torch or llama.cpp; a method ending
    in @torch or @llama.cpp runs on that backend instead, in the same run."""
    chosen = parse_entries(methods)
    prompts = load_dataset(dataset, limit)
    if max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    n_threads = _threads(threads)
    lm = load_with_progress(model, backend=backend)
    samples = _run_with_progress(lm, chosen, prompts, max_new_tokens, lambda other: load_with_progress(model, backend=other))
    meta = _meta(lm.name, dataset, limit, max_new_tokens, n_threads, len(prompts))
    meta["backend"] = backend
    k = {e.label: e.method.draft_length for e in chosen}
    paths = report.write_outputs(out, samples, meta, k)
    if plot:
        title = f"{lm.name}, {len(prompts)} prompts, {max_new_tokens} new tokens, greedy"
        paths["speedup_plot"] = plots.speedup_by_category(samples, out / "speedup_by_category.png", title)
        paths["hist_plot"] = plots.accepted_length_histogram(samples, out / "accepted_lengths.png", title)
    console.print(Markdown(paths["table"].read_text(encoding="utf-8")))
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    if any(s.lossless for s in report.mismatches(samples)):
        raise typer.Exit(1)


@app.command("report")
@friendly
def report_command(
    out: Annotated[Path, typer.Argument(help="A `leapdecode bench` output folder.")],
    readme: Annotated[Path | None, typer.Option("--readme", help="Also write the compact table into this README's results section.")] = None,
) -> None:
    """Re-render results.md and the plots of a bench run from its samples.jsonl (no re-run)."""
    samples_path, summary_path = out / "samples.jsonl", out / "summary.json"
    if not samples_path.is_file() or not summary_path.is_file():
        raise InputError(f"{out} is not a bench output folder (needs samples.jsonl and summary.json)")
    samples = report.read_samples(samples_path)
    meta = json.loads(summary_path.read_text(encoding="utf-8"))["meta"]
    draft_lengths = {e.label: e.method.draft_length for e in parse_entries(report.methods_in(samples))}
    report.write_outputs(out, samples, meta, draft_lengths)
    title = f"{meta['model']}, {meta['prompts']} prompts, {meta['max_new_tokens']} new tokens, greedy"
    plots.speedup_by_category(samples, out / "speedup_by_category.png", title)
    plots.accepted_length_histogram(samples, out / "accepted_lengths.png", title)
    if readme is not None:
        report.update_readme(readme, report.readme_table(samples, meta))
        console.print(f"updated {readme}")
    console.print(Markdown((out / "results.md").read_text(encoding="utf-8")))


def parse_grid(text: str) -> dict[str, list[int]]:
    """`n=2..6 k=1..10` or `n=3,5 k=4` -> {'n': [2..6], 'k': [1..10]}."""
    grid: dict[str, list[int]] = {}
    for item in filter(None, re.split(r"[\s;]+", text.strip())):
        name, eq, values = item.partition("=")
        if not eq:
            raise InputError(f"grid item {item!r} must look like name=A..B or name=A,B,C")
        try:
            if ".." in values:
                lo, hi = (int(v) for v in values.split(".."))
                if hi < lo:
                    raise InputError(f"grid range {values!r} is empty")
                grid[name] = list(range(lo, hi + 1))
            else:
                grid[name] = [int(v) for v in values.split(",")]
        except ValueError:
            raise InputError(f"grid values for {name!r} must be integers: {values!r}") from None
    if not 1 <= len(grid) <= 2:
        raise InputError("a sweep grid has one or two parameters, e.g. --grid 'n=2..6 k=1..10'")
    return grid


@app.command()
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
) -> None:
    """Speed-up of one method over a grid of its parameters (the ANPD paper's Figures 3-5)."""
    base = parse_method(method)
    axes = parse_grid(grid)
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(axes) - fields
    if unknown:
        raise MethodError(f"{base.name} has no parameter {', '.join(sorted(unknown))}; it has: {', '.join(sorted(fields)) or 'none'}")
    names = list(axes)
    points = [(a, b) for a in axes[names[0]] for b in (axes[names[1]] if len(names) == 2 else [0])]
    variants = {
        p: dataclasses.replace(base, **{names[0]: p[0], **({names[1]: p[1]} if len(names) == 2 else {})}) for p in points
    }
    prompts = load_dataset(dataset, limit)
    n_threads = _threads(threads)
    lm = load_with_progress(model)
    samples = _run_with_progress(lm, list(variants.values()), prompts, max_new_tokens)
    meta = _meta(lm.name, dataset, limit, max_new_tokens, n_threads, len(prompts))
    paths = report.write_outputs(out, samples, meta, {str(m): m.draft_length for m in variants.values()})
    aggs = report.aggregate(samples)
    speedups = {p: aggs[(str(m), "overall")].speedup for p, m in variants.items()}
    taus = {p: aggs[(str(m), "overall")].stats.tau for p, m in variants.items()}
    row_name, col_name = names[0], (names[1] if len(names) == 2 else "-")
    cols = sorted({b for _, b in points})
    over = f"{row_name} × {col_name}" if len(names) == 2 else row_name
    header = " | ".join(str(c) for c in cols) if len(names) == 2 else "speed-up (τ)"
    lines = [
        f"Speed-up (τ) of `{base.name}` over {over}: {meta['prompts']} prompts of {dataset}, "
        f"{max_new_tokens} new tokens, {lm.name}, {meta['machine']}.", "",
        "| " + (row_name + " \\ " + col_name if len(names) == 2 else row_name) + " | " + header + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for a in sorted({a for a, _ in points}):
        lines.append(f"| {a} | " + " | ".join(f"{speedups[(a, c)]:.2f}x ({taus[(a, c)]:.2f})" for c in cols) + " |")
    best = max(speedups, key=speedups.get)
    lines += ["", f"Best: `{variants[best]}` at {speedups[best]:.2f}x.", "", report.mismatch_report(samples)]
    (out / "sweep.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "sweep.json").write_text(json.dumps([{**dict(zip(names, p)), "speedup": speedups[p], "tau": taus[p]} for p in points], indent=2))
    title = f"{base.name} on {lm.name}: speed-up over {row_name} x {col_name} ({meta['prompts']} prompts)"
    plots.sweep_plots(speedups, out / "sweep_heatmap.png", out / "sweep_lines.png", title, (row_name, col_name))
    console.print(Markdown("\n".join(lines)))
    console.print(f"wrote {out}/sweep.md, sweep.json, sweep_heatmap.png, sweep_lines.png, samples.jsonl")


@app.command()
@friendly
def trace(
    prompt: PromptArg = None,
    model: ModelOpt = DEFAULT_MODEL,
    method: MethodOpt = "anpd",
    max_new_tokens: MaxNewOpt = 128,
    chat: ChatOpt = False,
    out: Annotated[Path | None, typer.Option("--out", help="Write a self-contained HTML page here.")] = None,
    show_rejected: Annotated[bool, typer.Option("--rejected/--no-rejected", help="Show rejected drafts.")] = True,
) -> None:
    """Show step by step which drafted tokens were accepted, rejected, and the bonus tokens."""
    from leapdecode.api import wrap
    from leapdecode.bench.trace import render_html, render_terminal, trace_steps

    text = read_prompt(prompt)
    parse_method(method)
    decoder = wrap(load_with_progress(model), method)
    result = decoder.generate(text, max_new_tokens=max_new_tokens, chat=chat)
    steps = trace_steps(result, decoder.lm.tokenizer)
    console.print(render_terminal(steps, show_rejected))
    console.print("legend: [black on green3]accepted draft[/] [black on yellow]bonus token[/] [red strike]rejected draft[/] │ = one forward pass")
    console.print(f"[dim]{result.method} | {result.stats.summary()}[/]")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(result, steps, decoder.lm.name, text), encoding="utf-8")
        console.print(f"wrote {out}")


@app.command("forward-cost")
@friendly
def forward_cost(
    model: ModelOpt = DEFAULT_MODEL,
    tokens: Annotated[str, typer.Option("--tokens", help="Comma list of token counts to score in one pass.")] = "1,2,4,8,12,16,24,32,48,64",
    context: Annotated[int, typer.Option("--context", help="Cached context length before each pass.")] = 300,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed passes per size (median).")] = 5,
    out: Annotated[Path | None, typer.Option("--out", help="Also write the table (markdown) and a plot here (folder).")] = None,
    threads: BenchThreadsOpt = 0,
) -> None:
    """Time one forward pass against the number of tokens it scores (draft and tree sizes)."""
    from leapdecode.bench.forward_cost import compare, markdown

    try:
        sizes = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise InputError(f"--tokens must be a comma list of integers, got {tokens!r}") from None
    if not sizes or min(sizes) < 1 or max(sizes) > 512 or context < 1 or repeats < 1:
        raise InputError("--tokens must be between 1 and 512, --context and --repeats at least 1")
    sizes = sorted(set(sizes) | {1})
    n_threads = _threads(threads)
    lm = load_with_progress(model)
    results = compare(lm, sizes, context, repeats)
    table = markdown(results, f"One forward pass of `{lm.name}` after {context} cached tokens, median of {repeats}; {machine_description(n_threads)}.")
    console.print(Markdown(table))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "forward_cost.md").write_text(table + "\n", encoding="utf-8")
        plots.forward_cost_plot(results, out / "forward_cost.png", f"{lm.name}: one forward pass vs tokens scored")
        console.print(f"wrote {out}/forward_cost.md, forward_cost.png")

