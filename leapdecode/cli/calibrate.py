"""`leapdecode calibrate layer-skip` and `leapdecode calibrate calm`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from leapdecode.cli.common import (
    DEFAULT_MODEL,
    DtypeOpt,
    ModelOpt,
    QuantizeOpt,
    ThreadsOpt,
    console,
    err_console,
    friendly,
    load_with_progress,
    set_threads,
)

if TYPE_CHECKING:
    from leapdecode.models import LoadedModel

calibrate_app = typer.Typer(help="Calibrate early-exit and layer-skipping methods for a model.", no_args_is_help=True)

PerCategoryOpt = Annotated[
    int, typer.Option("--prompts", help="Calibration prompts per category (HumanEval + Spec-Bench's six).")
]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens generated per calibration prompt.")]


def _calibration_ids(lm: LoadedModel, per_category: int) -> list[list[int]]:
    from leapdecode.api import encode_prompt
    from leapdecode.bench.datasets import calibration_set

    return [encode_prompt(lm, p.text, chat=p.chat) for p in calibration_set(per_category)]


@friendly
def calibrate_layer_skip_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    per_category: PerCategoryOpt = 1,
    max_new_tokens: MaxNewOpt = 48,
    k: Annotated[int, typer.Option("--k", help="Draft length tried.")] = 4,
    threshold: Annotated[float, typer.Option("--threshold", help="Draft confidence threshold tried.")] = 0.5,
    out: Annotated[Path | None, typer.Option("--out", help="Also write the calibration JSON here.")] = None,
    fractions: Annotated[
        str, typer.Option("--fractions", help="Shares of the layers to try skipping, comma-separated.")
    ] = "0.1,0.2,0.3,0.4,0.5",
    threads: ThreadsOpt = 0,
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = "auto",
) -> None:
    """Find the layers `self-spec` should skip on this machine (block influence ranking, then timed
    trials), and save them for `--method self-spec`."""
    from leapdecode.bench.calibrate import calibrate_layer_skip
    from leapdecode.early_exit.layer_sets import calibration_path
    from leapdecode.errors import InputError
    from leapdecode.models import default_cache_dir

    try:
        shares = [float(f) for f in fractions.split(",") if f.strip()]
    except ValueError:
        raise InputError(f"--fractions takes numbers like 0.2,0.4, got {fractions!r}") from None
    if not shares or not all(0 < f < 1 for f in shares):
        raise InputError(f"--fractions must be shares in (0, 1), got {fractions!r}")
    set_threads(threads)
    lm = load_with_progress(model, dtype=dtype, quantize=quantize)
    prompts = _calibration_ids(lm, per_category)
    result = calibrate_layer_skip(
        lm,
        prompts,
        max_new_tokens=max_new_tokens,
        fractions=shares,
        k=k,
        threshold=threshold,
        log=lambda m: err_console.log(m),
    )
    table = Table(
        "skip", "layers", "ms/token", "tau", "vs plain", title=f"self-spec on {lm.name} ({len(prompts)} prompts)"
    )
    for trial in result.trials:
        table.add_row(
            str(trial["skip"]),
            str(trial["layers_skipped"]),
            f"{trial['ms_per_token']:.1f}",
            f"{trial['tau']:.2f}",
            f"{result.plain_ms_per_token / float(trial['ms_per_token']):.2f}x",
        )
    console.print(table)
    path = calibration_path(default_cache_dir(), lm.fingerprint)
    result.save(path)
    if out is not None:
        result.save(out)
    console.print(f"[green]saved[/] {path}: `--method self-spec` now skips {result.skip}")


@friendly
def calibrate_calm_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    measure: Annotated[str, typer.Option("--measure", help="softmax or state.")] = "softmax",
    epsilon: Annotated[float, typer.Option("--epsilon", help="Tolerated disagreement with the full model.")] = 0.05,
    first: Annotated[int, typer.Option("--first", help="First layer a token may exit after.")] = 0,
    every: Annotated[int, typer.Option("--every", help="Check confidence every this many layers.")] = 1,
    per_category: PerCategoryOpt = 1,
    max_new_tokens: MaxNewOpt = 48,
    threads: ThreadsOpt = 0,
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = "auto",
) -> None:
    """Pick a CALM threshold whose simulated agreement with the full model stays >= 1 - epsilon."""
    import torch

    from leapdecode.api import wrap
    from leapdecode.choices import CALM_MEASURES as MEASURES
    from leapdecode.early_exit.backend import LayerBackend
    from leapdecode.early_exit.calm import (
        exit_candidates,
        layer_confidences,
        pick_threshold,
        simulate_thresholds,
    )
    from leapdecode.errors import InputError

    if measure not in MEASURES:
        raise InputError(f"--measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    if not 0 < epsilon < 1:
        raise InputError(f"--epsilon must be in (0, 1), got {epsilon}")
    set_threads(threads)
    lm = load_with_progress(model, dtype=dtype, quantize=quantize)
    backend = LayerBackend(lm.model)
    candidates = exit_candidates(backend.runner.num_layers, first, every)
    if not candidates:
        raise InputError(f"no layer to exit after with --first {first} --every {every}")
    plain = wrap(lm, "ar")
    confs, preds, finals = [], [], []
    for ids in _calibration_ids(lm, per_category):
        generated = plain.generate(ids, max_new_tokens=max_new_tokens).token_ids
        c, p, f = layer_confidences(backend, ids + generated, measure, candidates)
        start = len(ids) - 1  # rows that predict the generated tokens
        confs.append(c[:, start:-1])
        preds.append(p[:, start:-1])
        finals.append(f[start:-1])
    conf, pred, final = torch.cat(confs, 1), torch.cat(preds, 1), torch.cat(finals)
    grid = sorted(
        {round(float(q), 4) for q in torch.quantile(conf.flatten().float(), torch.linspace(0, 1, 41))} | {1.0}
    )
    points = simulate_thresholds(conf, pred, final, candidates, backend.runner.num_layers, grid)
    best = pick_threshold(points, epsilon)
    table = Table(
        "threshold", "agreement", "mean layers", title=f"CALM ({measure}) on {lm.name}: {final.numel()} tokens"
    )
    for point in points:
        mark = " <" if point is best else ""
        table.add_row(f"{point.threshold:.4f}", f"{point.agreement:.3f}", f"{point.mean_layers:.1f}{mark}")
    console.print(table)
    console.print(
        f"use --method calm:threshold={best.threshold:.4f},measure={measure},first={first},every={every} "
        f"(simulated agreement {best.agreement:.3f}, {best.mean_layers:.1f} of {backend.runner.num_layers} layers per "
        f"token)"
    )


def register(app: typer.Typer) -> None:
    calibrate_app.command("layer-skip")(calibrate_layer_skip_cmd)
    calibrate_app.command("calm")(calibrate_calm_cmd)
    app.add_typer(calibrate_app, name="calibrate")
