"""What the benchmark commands share: the machine's description, threads, a progress bar over a
run, run metadata (what ran, where, when, from which commit), and sweep grids."""

from __future__ import annotations

import os
import re
import subprocess
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import leapdecode
from leapdecode.bench.datasets import BenchPrompt
from leapdecode.bench.entries import Entry, Variant
from leapdecode.bench.labels import short_label
from leapdecode.bench.runner import BASELINE, Sample, run_benchmark
from leapdecode.engine.sampling import SamplingParams
from leapdecode.errors import InputError
from leapdecode.methods import Method
from leapdecode.models import LoadedModel
from leapdecode.models.hardware import cpu_name


def machine_description(threads: int) -> str:
    cpu = cpu_name()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {device}, torch {torch.__version__}, {threads} threads"


def use_threads(threads: int) -> int:
    """Set torch's CPU threads (0: all cores, or OMP_NUM_THREADS where the environment sets it, as
    torch's own default does) and return the number in use."""
    if threads < 0:
        raise InputError(f"--threads must be >= 0, got {threads}")
    from_env = os.environ.get("OMP_NUM_THREADS", "")
    default = int(from_env) if from_env.isdigit() and int(from_env) > 0 else (os.cpu_count() or 1)
    torch.set_num_threads(threads or default)
    return torch.get_num_threads()


def run_with_progress(
    console: Console,
    lm: LoadedModel,
    methods: Sequence[Method | Entry],
    prompts: Sequence[BenchPrompt],
    max_new_tokens: int,
    load_variant: Callable[[Variant], LoadedModel] | None = None,
    repeats: int = 1,
    sampling: SamplingParams = SamplingParams(),
) -> list[Sample]:
    """`run_benchmark` with a live progress bar and running speed-ups."""
    times: dict[str, float] = defaultdict(float)
    total = len(prompts) * (1 + sum(1 for m in methods if (m.label if isinstance(m, Entry) else str(m)) != BASELINE))
    with Progress(
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[live]}"),
        console=console,
    ) as progress:
        task = progress.add_task("bench", total=total, live="warming up")

        def on_sample(sample: Sample) -> None:
            times[sample.method] += sample.wall_time_s
            plain = times[BASELINE]
            live = "  ".join(
                f"{short_label(m, lm.backend)} {plain / t:.2f}x" for m, t in times.items() if m != BASELINE and t > 0
            )
            progress.update(task, advance=1, live=live or "plain decoding")

        return run_benchmark(
            lm,
            methods,
            prompts,
            max_new_tokens,
            on_sample=on_sample,
            log=console.log,
            load_variant=load_variant,
            repeats=repeats,
            sampling=sampling,
        )


def run_meta(
    model: str,
    dataset: str,
    limit: str,
    max_new_tokens: int,
    threads: int,
    n_prompts: int,
    weights: str = "",
) -> dict[str, object]:
    """The run's description for the report; `weights` says what the model computes in
    (`torch bfloat16`, `llama.cpp gguf`), the same for every method and peer on that backend.
    `date`, `commit` and `version` say which code made the numbers, so that a table can be
    traced back to it."""
    return {
        "model": model,
        "weights": weights,
        "dataset": dataset,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "prompts": n_prompts,
        "machine": machine_description(threads),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "version": leapdecode.__version__,
    }


def source_commit() -> str | None:
    """`git rev-parse --short HEAD` of the checkout this package runs from, with `-dirty` when a
    tracked file has changes; None when the package is not run from a git checkout (installed)."""
    package = Path(leapdecode.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != package.parent:  # a checkout of something else around an install
        return None
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit}-dirty" if changes else commit


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
