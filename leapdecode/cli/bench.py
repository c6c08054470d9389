"""The benchmark commands: bench and report (sweep, trace and forward-cost: `cli.measure`).

Each command imports the benchmark (and so torch) when it runs, not when the CLI starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markdown import Markdown

from leapdecode.cli.common import (
    DEFAULT_MODEL,
    BackendOpt,
    BenchThreadsOpt,
    DatasetOpt,
    DtypeOpt,
    LimitOpt,
    MaxNewOpt,
    ModelOpt,
    OutOpt,
    QuantizeOpt,
    RowExactOpt,
    console,
    err_console,
    friendly,
    load_with_progress,
)
from leapdecode.errors import InputError

if TYPE_CHECKING:
    from leapdecode.bench.datasets import BenchPrompt
    from leapdecode.models import LoadedModel

DEFAULT_METHODS = "ar,anpd:n=5,k=7,pld:k=10,max_ngram=3,hf,hf-pld:tokens=10,max_ngram=3"  # prompt lookups alike


@friendly
def bench(
    model: ModelOpt = DEFAULT_MODEL,
    methods: Annotated[
        str, typer.Option("--methods", help="Comma list of method strings; `ar` always runs first.")
    ] = DEFAULT_METHODS,
    dataset: DatasetOpt = "humaneval+spec-bench",
    limit: LimitOpt = "10",
    max_new_tokens: MaxNewOpt = 128,
    out: OutOpt = Path("out/bench"),
    threads: BenchThreadsOpt = 0,
    plot: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots.")] = True,
    backend: BackendOpt = "torch",
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            help="Timed runs per method and prompt (median; the overall speed-up shows the spread). With "
            "--concurrency: rounds of every method at every concurrency, interleaved, merged per cell.",
        ),
    ] = 1,
    dtype: DtypeOpt = "auto",
    row_exact: RowExactOpt = None,
    quantize: QuantizeOpt = "auto",
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature",
            help=(
                "0: greedy; above 0: every method samples prompt i with seed SEED+i (lossless methods must give plain "
                "sampling's text)."
            ),
        ),
    ] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens (0: off).")] = 0,
    top_p: Annotated[
        float,
        typer.Option("--top-p", help="Sample from the smallest set of tokens with this much probability (1: off)."),
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="The first prompt's seed when sampling.")] = 0,
    concurrency: Annotated[
        str | None,
        typer.Option(
            "--concurrency",
            help=(
                "Comma list of client counts (e.g. 1,2,4,8): serve the prompts to that many closed-loop clients at "
                "once through the batch scheduler, per method (greedy; engine methods on this model, and "
                "llama-server: llama.cpp's server under the same load)."
            ),
        ),
    ] = None,
    max_pass_rows: Annotated[
        int, typer.Option("--max-pass-rows", help="With --concurrency: tokens one shared pass may score.")
    ] = 128,
    prefix_cache_tokens: Annotated[
        int,
        typer.Option(
            "--prefix-cache-tokens",
            help=(
                "With --concurrency: tokens of finished requests' caches the shared passes keep for prompts that "
                "begin the same way, as `serve` does (llama-server then caches prompts too); 0: off."
            ),
        ),
    ] = 0,
    system: Annotated[
        str | None,
        typer.Option(
            "--system",
            help=(
                "A system message before every prompt (the load of a deployed assistant: with --concurrency and "
                "--prefix-cache-tokens, requests share its prefill)."
            ),
        ),
    ] = None,
) -> None:
    """Run methods and peers side by side (interleaved, one run) and write tables and plots.
    `--backend`, `--dtype` and `--quantize` say what runs the model (and `ar`, the baseline); a
    method ending in @VARIANT runs on another model in the same run: @llama.cpp or @torch (a
    backend), @bfloat16 or @float32 (a dtype), @int8 or @int4 (a quantization), or several
    joined with + (@torch+int4); `ar@VARIANT` is that model's own plain decoding."""
    from leapdecode.bench import plots, report
    from leapdecode.bench.datasets import load_dataset, with_system
    from leapdecode.bench.entries import Variant, parse_entries
    from leapdecode.bench.harness import run_meta, run_with_progress, use_threads
    from leapdecode.bench.labels import short_label
    from leapdecode.bench.llamacpp_server import gguf_of
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.heads.store import describe_head
    from leapdecode.methods import LlamaCppServer
    from leapdecode.models import default_cache_dir

    chosen = parse_entries(methods)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    prompts = load_dataset(dataset, limit)
    if system is not None:
        prompts = with_system(prompts, system)
    if max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    n_threads = use_threads(threads)
    if repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {repeats}")
    own = Variant().load_arguments(backend, dtype, quantize)
    clients = parse_concurrency(concurrency) if concurrency is not None else None
    if clients is not None and not sampling.greedy:
        raise InputError("--concurrency measures greedy decoding; leave out --temperature")
    serves = any(isinstance(e.method, LlamaCppServer) for e in chosen)
    if clients is not None and any(
        "@" in e.label or (e.method.capabilities.peer and not isinstance(e.method, LlamaCppServer)) for e in chosen
    ):
        raise InputError(
            "--concurrency runs engine methods on the loaded model and llama-server: leave out other peers and "
            "@variants (e.g. --methods ar,anpd,llama-server)"
        )
    if prefix_cache_tokens < 0 or (prefix_cache_tokens and clients is None):
        raise InputError("--prefix-cache-tokens takes a count >= 0, with --concurrency")
    if clients is None and serves:
        raise InputError("llama-server is a throughput peer: run it with --concurrency (e.g. --concurrency 1,4)")
    loaded = {
        own: load_with_progress(model, backend=own[0], dtype=own[1] or dtype, row_exact=row_exact, quantize=own[2])
    }
    if clients is not None:
        gguf = gguf_of(model, default_cache_dir()) if serves else None  # a preset's, pulled by the load above
        bench_concurrency(
            loaded[own],
            [str(e.method) for e in chosen],
            prompts,
            max_new_tokens,
            clients,
            max_pass_rows,
            out,
            gguf,
            prefix_cache_tokens,
            repeats,
            {
                **run_meta(
                    loaded[own].name, dataset, limit, max_new_tokens, n_threads, len(prompts), loaded[own].describe
                ),
                **system_meta(loaded[own], system),
            },
        )
        return

    def load_variant(variant: Variant) -> LoadedModel:  # one model per distinct (backend, dtype, quantize)
        arguments = variant.load_arguments(backend, dtype, quantize)
        if arguments not in loaded:
            other, other_dtype, other_quantize = arguments
            loaded[arguments] = load_with_progress(
                model, backend=other, dtype=other_dtype or dtype, row_exact=row_exact, quantize=other_quantize
            )
        return loaded[arguments]

    lm = loaded[own]
    samples = run_with_progress(
        console, lm, chosen, prompts, max_new_tokens, load_variant, repeats=repeats, sampling=sampling
    )
    meta = run_meta(lm.name, dataset, limit, max_new_tokens, n_threads, len(prompts), lm.describe)
    meta.update(system_meta(lm, system))
    meta["backend"] = backend
    meta["repeats"] = repeats
    meta["decoding"] = (
        "greedy"
        if sampling.greedy
        else f"sampled: temperature {temperature}, top_k {top_k}, top_p {top_p}, seeds {seed}+"
    )
    heads: dict[str, list[str]] = {}  # which head each method ran with, once per head
    for e in chosen:
        head = e.method.capabilities.head
        if head is not None:
            heads.setdefault(describe_head(head, e.method.name, lm), []).append(f"`{short_label(e.label, lm.backend)}`")
    if heads:
        meta["heads"] = {", ".join(labels): about for about, labels in heads.items()}
    k = {**{str(e.method): e.method.draft_length for e in chosen}, **{e.label: e.method.draft_length for e in chosen}}
    paths = report.write_outputs(out, samples, meta, k)
    if plot:
        title = f"{lm.name}, {len(prompts)} prompts, {max_new_tokens} new tokens, {meta['decoding']}"
        paths["speedup_plot"] = plots.speedup_by_category(samples, out / "speedup_by_category.png", title)
        paths["hist_plot"] = plots.accepted_length_histogram(samples, out / "accepted_lengths.png", title)
    console.print(Markdown(paths["table"].read_text(encoding="utf-8")))
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    if any(s.lossless for s in report.mismatches(samples)):
        raise typer.Exit(1)


def system_meta(lm: LoadedModel, system: str | None) -> dict[str, object]:
    """The report's line for `--system`: how long the shared system message is."""
    if system is None:
        return {}
    tokens = len(lm.tokenizer(system, add_special_tokens=False)["input_ids"])
    return {"system message": f"{tokens} tokens (the message alone, without the chat template's), before every prompt"}


def parse_concurrency(text: str) -> list[int]:
    try:
        clients = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--concurrency takes a comma list of client counts, got {text!r}") from None
    if not clients or any(c < 1 for c in clients):
        raise InputError(f"--concurrency takes client counts of at least 1, got {text!r}")
    return clients


def bench_concurrency(
    lm: LoadedModel,
    methods: list[str],
    prompts: list[BenchPrompt],
    max_new_tokens: int,
    clients: list[int],
    max_pass_rows: int,
    out: Path,
    gguf: Path | None,
    prefix_cache_tokens: int,
    rounds: int,
    meta: dict[str, object],
) -> None:
    """`bench --concurrency`: every method one at a time and with each number of clients at once,
    `rounds` times over, interleaved."""
    from leapdecode.api import Decoder
    from leapdecode.bench.concurrent import concurrency_table, run_concurrency_bench
    from leapdecode.bench.runner import encode_turns

    plain = Decoder(lm, "ar")
    ids = [
        encode_turns(lm, p, lambda ids: plain.generate(ids, max_new_tokens=max_new_tokens).token_ids) for p in prompts
    ]
    results = run_concurrency_bench(
        lm,
        methods,
        ids,
        max_new_tokens,
        clients,
        max_rows=max_pass_rows,
        gguf=gguf,
        prefix_cache_tokens=prefix_cache_tokens,
        rounds=rounds,
        log=err_console.log,
    )
    meta = {**meta, "prefix cache tokens": prefix_cache_tokens, "rounds": rounds}
    out.mkdir(parents=True, exist_ok=True)
    table = concurrency_table(results)
    lines = [f"- {key}: {value}" for key, value in meta.items()]
    (out / "concurrency.md").write_text(
        "# Concurrent requests\n\n" + "\n".join(lines) + "\n\n" + table, encoding="utf-8"
    )
    (out / "concurrency.json").write_text(
        json.dumps({"meta": meta, "results": [r.summary() for r in results]}, indent=2), encoding="utf-8"
    )
    console.print(Markdown(table))
    console.print(f"wrote {out / 'concurrency.md'}, {out / 'concurrency.json'}")
    if any(r.identical != r.requests for r in results if not r.peer):
        raise typer.Exit(1)


@friendly
def report_command(
    run: Annotated[Path, typer.Argument(help="A `leapdecode bench` output folder (samples.jsonl and summary.json).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the re-rendered outputs here instead of into RUN.")
    ] = None,
    readme: Annotated[
        Path | None, typer.Option("--readme", help="Also write the compact table into this README's results section.")
    ] = None,
    date: Annotated[
        str | None, typer.Option("--date", help="The run's date (ISO), for a run recorded without one.")
    ] = None,
    commit: Annotated[
        str | None, typer.Option("--commit", help="The commit the run came from, for a run recorded without one.")
    ] = None,
) -> None:
    """Re-render a bench run's results.md, summary.json and plots from its samples.jsonl with the
    current labels and checks (no re-run). Meta the run did not record stays missing unless given."""
    from leapdecode.bench import plots, readme_table, report
    from leapdecode.bench.labels import method_of

    samples_path, summary_path = run / "samples.jsonl", run / "summary.json"
    if not samples_path.is_file() or not summary_path.is_file():
        raise InputError(f"{run} is not a bench output folder (needs samples.jsonl and summary.json)")
    samples = report.read_samples(samples_path)
    meta = json.loads(summary_path.read_text(encoding="utf-8"))["meta"]
    meta.update({key: value for key, value in (("date", date), ("commit", commit)) if value is not None})
    methods = {label: method_of(label) for label in report.methods_in(samples)}
    draft_lengths = {label: method.draft_length for label, method in methods.items() if method is not None}
    target = out or run
    paths = report.write_outputs(target, samples, meta, draft_lengths)
    title = f"{meta.get('model')}, {meta.get('prompts')} prompts, {meta.get('max_new_tokens')} new tokens, greedy"
    paths["speedup_plot"] = plots.speedup_by_category(samples, target / "speedup_by_category.png", title)
    paths["hist_plot"] = plots.accepted_length_histogram(samples, target / "accepted_lengths.png", title)
    if readme is not None:
        readme_table.update_readme(readme, readme_table.readme_table(samples, meta))
        console.print(f"updated {readme}")
    console.print(Markdown(paths["table"].read_text(encoding="utf-8")))
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def register(app: typer.Typer) -> None:
    app.command()(bench)
    app.command("report")(report_command)
