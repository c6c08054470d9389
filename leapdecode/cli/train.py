"""`leapdecode train-drafter`: train an EAGLE-3 or Medusa head for a model, on CPU, resumably;
`leapdecode draft-vocab`: rank a model's tokens for draft vocabularies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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


@friendly
def train_drafter(
    model: ModelOpt = DEFAULT_MODEL,
    method: Annotated[str, typer.Option("--method", help="eagle3 or medusa.")] = "eagle3",
    data: Annotated[
        str, typer.Option("--data", help="sharegpt (ShareGPT V3, the train extra) or a .jsonl file of conversations.")
    ] = "sharegpt",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help=(
                "Run folder: checkpoints, cached target states, and the head in out/head (default: where "
                "eagle3/medusa look for this model's head)."
            ),
        ),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps, one sequence each.")] = 2000,
    lr: Annotated[float, typer.Option("--lr")] = 3e-4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Longest training sequence, in tokens.")] = 512,
    ttt_steps: Annotated[int, typer.Option("--ttt-steps", help="EAGLE-3: steps of the training-time test.")] = 4,
    draft_vocab: Annotated[
        int,
        typer.Option(
            "--draft-vocab",
            help=(
                "Draft vocabulary size. EAGLE-3: 0 is min(32000, the model's). Medusa: 0 gives each head its own full "
                "LM head; a size makes the heads share the model's LM head over the most frequent tokens (vLLM's "
                "format)."
            ),
        ),
    ] = 0,
    intermediate_size: Annotated[
        int, typer.Option("--intermediate-size", help="EAGLE-3: the head's MLP width (0: the model's).")
    ] = 0,
    heads: Annotated[int, typer.Option("--heads", help="Medusa: number of heads.")] = 4,
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            help=(
                "Training conversations kept, a seeded sample (0: all); the whole source is still read, so the "
                "held-out set stays the same."
            ),
        ),
    ] = 0,
    eval_every: Annotated[
        int, typer.Option("--eval-every", help="Steps between held-out acceptance measurements.")
    ] = 250,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Steps between checkpoints.")] = 100,
    cache_gb: Annotated[float, typer.Option("--cache-gb", help="Most disk the cached target states take.")] = 4.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    mixed_precision: Annotated[
        bool,
        typer.Option(
            "--mixed-precision/--float32",
            help="bfloat16 products where the hardware has them natively (float32 weights and optimizer state).",
        ),
    ] = True,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its checkpoint.")] = False,
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = "auto",
    threads: ThreadsOpt = 0,
) -> None:
    """Train a draft head (EAGLE-3 or Medusa) for MODEL on conversations, never on benchmark prompts."""
    from leapdecode.heads.store import run_folder
    from leapdecode.training.settings import TrainSettings
    from leapdecode.training.train import train_drafter as train

    set_threads(threads)
    settings = TrainSettings(
        method=method,
        data=data,
        steps=steps,
        lr=lr,
        max_tokens=max_tokens,
        ttt_steps=ttt_steps,
        draft_vocab=draft_vocab,
        intermediate_size=intermediate_size,
        medusa_heads=heads,
        limit=limit,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        cache_gb=cache_gb,
        seed=seed,
        mixed_precision=mixed_precision,
    )
    lm = load_with_progress(model, dtype=dtype, quantize=quantize)
    folder = out if out is not None else run_folder(lm.name, method)
    err_console.log(f"training in {folder}")
    head = train(lm, settings, folder, resume=resume, log=err_console.log)
    console.print(f"{method} head written to {head}")


@friendly
def draft_vocab(
    model: ModelOpt = DEFAULT_MODEL,
    data: Annotated[
        str, typer.Option("--data", help="sharegpt (ShareGPT V3, the train extra) or a .jsonl file of conversations.")
    ] = "sharegpt",
    conversations: Annotated[
        int, typer.Option("--conversations", help="Training conversations whose answers are counted.")
    ] = 2000,
) -> None:
    """Rank MODEL's tokens by how often answers use them: the draft vocabulary `draft:vocab=V` keeps."""
    from leapdecode.models import default_cache_dir
    from leapdecode.training.vocabulary import write_ranking

    if conversations < 1:
        raise typer.BadParameter("--conversations must be at least 1")
    lm = load_with_progress(model)
    path, ranked = write_ranking(lm.tokenizer, default_cache_dir(), data, conversations)
    console.print(f"{ranked} distinct tokens ranked in {path}")


def register(app: typer.Typer) -> None:
    app.command("train-drafter")(train_drafter)
    app.command("draft-vocab")(draft_vocab)
