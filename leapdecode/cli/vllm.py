"""`leapdecode vllm-serve` and `leapdecode vllm-bench`: our drafters inside vLLM (the `vllm` extra)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from leapdecode.cli.common import DEFAULT_MODEL, MaxNewOpt, ModelOpt, console, err_console, friendly
from leapdecode.errors import InputError, LeapDecodeError

VLLM_MISSING = (
    "vLLM is not installed in this environment: pip install 'leapdecode[vllm]' (or `make vllm`, then use "
    ".venv-vllm/bin/leapdecode)"
)


@friendly
def vllm_serve(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="Our method drafting inside vLLM: anpd, pld or suffix, with parameters (none: no speculation).",
        ),
    ] = "anpd",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the vLLM command instead of running it.")] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with one of our drafters as its proposer. Any other
    option is vLLM's own (`--port 8000`, `--dtype bfloat16`, `--max-num-seqs 8`, ...) and goes to
    `vllm serve` unchanged. A preset or GGUF model is served from its de-quantized folder."""
    from leapdecode.integrations.vllm_setup import serve_command, vllm_method
    from leapdecode.models.loading import huggingface_source

    spec = None if method.strip().lower() == "none" else vllm_method(method)
    if importlib.util.find_spec("vllm") is None and not dry_run:
        raise LeapDecodeError(VLLM_MISSING)
    argv = serve_command(huggingface_source(model, log=err_console.log), spec, ctx.args)
    if dry_run:
        console.print(shlex.join(argv), markup=False, highlight=False, soft_wrap=True)
        return
    err_console.log(f"vLLM serving {argv[4]} with {spec or 'no speculation'}")
    os.execv(argv[0], argv)


@friendly
def vllm_bench(
    model: ModelOpt = DEFAULT_MODEL,
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            help=(
                "Comma list: none, vllm-ngram[:k=K,n=N], vllm-suffix[:k=K], and our anpd/pld/suffix strings; `none` "
                "runs first."
            ),
        ),
    ] = "none,vllm-ngram:k=7,n=3,anpd:n=5,k=7",
    dataset: Annotated[
        str,
        typer.Option("--dataset", "-d", help="humaneval, spec-bench, spec-bench:CATEGORY, a JSONL file; join with +."),
    ] = "humaneval+spec-bench",
    limit: Annotated[
        str, typer.Option("--limit", help="Prompts per category: N, or N,CATEGORY=M,...")
    ] = "3,humaneval=10",
    max_new_tokens: MaxNewOpt = 128,
    concurrency: Annotated[
        str, typer.Option("--concurrency", help="Comma list of requests in flight (1: one after another).")
    ] = "1,8",
    dtype: Annotated[str, typer.Option("--dtype", help="vLLM's dtype: float32 or bfloat16.")] = "float32",
    threads: Annotated[int, typer.Option("--threads", help="Torch CPU threads in the engine (0: vLLM's default).")] = 0,
    python: Annotated[
        str | None, typer.Option("--python", help="Python with the vllm extra (default: this one).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Output folder.")] = Path("out/vllm-bench"),
) -> None:
    """The same prompts through vLLM with no speculation, vLLM's own proposers and ours: output
    tok/s, mean acceptance length, latency p50, identical outputs (greedy), one engine per row."""
    from leapdecode.bench.datasets import load_dataset
    from leapdecode.bench.vllm_bench import parse_vllm_entries, run_vllm_bench, summary, vllm_table
    from leapdecode.models import load_model
    from leapdecode.models.loading import huggingface_source

    entries = parse_vllm_entries(methods)
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise InputError(f"--concurrency is a comma list of integers, got {concurrency!r}") from None
    if not levels or min(levels) < 1 or max_new_tokens < 1:
        raise InputError("--concurrency needs positive integers and --max-new-tokens must be >= 1")
    interpreter = python or sys.executable
    if python is None and importlib.util.find_spec("vllm") is None:
        raise LeapDecodeError(VLLM_MISSING)
    prompts = [
        p for p in load_dataset(dataset, limit) if not p.earlier
    ]  # later turns need answers from a target: not here
    source = huggingface_source(model, log=err_console.log)
    lm = load_model(
        source, log=err_console.log, dtype="float32", quantize="none", row_exact=False, small_batch_linear=False
    )  # the tokenizer and chat template
    from leapdecode.api import encode_prompt

    ids = [encode_prompt(lm, p.text, chat=p.chat) for p in prompts]
    longest = max(len(i) for i in ids) + max_new_tokens
    rows = run_vllm_bench(
        source,
        entries,
        ids,
        max_new_tokens,
        levels,
        python=interpreter,
        dtype=dtype,
        threads=threads,
        max_model_len=min(lm.max_context, max(1024, longest)),
        log=err_console.log,
    )
    table = vllm_table(rows, [p.category for p in prompts])
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": model,
        "source": source,
        "dataset": dataset,
        "limit": limit,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "threads": threads,
        "concurrency": levels,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": summary(rows)}, indent=1), encoding="utf-8")
    header = f"{model} through vLLM ({dtype}), {len(prompts)} prompts, {max_new_tokens} new tokens, greedy\n\n"
    (out / "vllm_table.md").write_text(header + table, encoding="utf-8")
    console.print(header + table, markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    passthrough = {"allow_extra_args": True, "ignore_unknown_options": True}
    app.command("vllm-serve", context_settings=passthrough)(vllm_serve)
    app.command("vllm-bench")(vllm_bench)
