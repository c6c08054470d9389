"""`leapdecode chat`: a conversation in the terminal, each turn starting from the last one's cache."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from leapdecode.cli.common import (
    DEFAULT_MODEL,
    BackendOpt,
    DefaultMethodOpt,
    DtypeOpt,
    MaxNewOpt,
    ModelOpt,
    QuantizeOpt,
    RowExactOpt,
    ThreadsOpt,
    chosen_method,
    console,
    err_console,
    friendly,
    load_with_progress,
    print_stream,
    set_threads,
)


@friendly
def chat(
    model: ModelOpt = DEFAULT_MODEL,
    method: DefaultMethodOpt = None,
    max_new_tokens: MaxNewOpt = 512,
    system: Annotated[str | None, typer.Option("--system", help="A system message before the conversation.")] = None,
    threads: ThreadsOpt = 0,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0: greedy; above 0: sample (lossless speculative sampling).")
    ] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Make sampled answers reproducible.")] = None,
    prefix_cache_tokens: Annotated[
        int,
        typer.Option(
            "--prefix-cache-tokens",
            help="Tokens of earlier turns' KV caches kept, so that a turn prefills only its new message (0: off).",
        ),
    ] = 8192,
    backend: BackendOpt = "torch",
    dtype: DtypeOpt = "auto",
    row_exact: RowExactOpt = None,
    quantize: QuantizeOpt = "auto",
) -> None:
    """Chat with the model in the terminal: each answer streams, then one line of statistics. A
    turn starts from the last turn's kept cache and prefills only the new message (the same answer
    as without it). An empty line or the end of input ends the conversation."""
    from leapdecode.api import Decoder
    from leapdecode.engine import GenerationStats
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.methods import parse_method

    set_threads(threads)
    if method is not None:
        parse_method(method)  # a bad method string, sampling setting or size fails before the model loads
    SamplingParams(temperature, 0, 1.0, seed)
    if prefix_cache_tokens < 0:
        raise typer.BadParameter("--prefix-cache-tokens must be >= 0 (0: off)")
    lm = load_with_progress(model, backend=backend, dtype=dtype, row_exact=row_exact, quantize=quantize)
    decoder = Decoder(lm, chosen_method(lm, method), prefix_cache_tokens=prefix_cache_tokens)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = console.input("[bold]you>[/] ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        saved = decoder.prefix_cache.hit_tokens if decoder.prefix_cache is not None else 0
        start = time.perf_counter()
        stream = decoder.stream(messages, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        steps = print_stream(lm.tokenizer, stream)
        stats = GenerationStats.from_steps(steps, time.perf_counter() - start)
        reply = lm.tokenizer.decode([t for s in steps for t in s.tokens], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        cached = (decoder.prefix_cache.hit_tokens - saved) if decoder.prefix_cache is not None else 0
        err_console.print(
            f"[dim]{stats.summary()} | prompt {len(stream.prompt_ids)} tokens, {cached} from the last turns' cache[/]"
        )


def register(app: typer.Typer) -> None:
    app.command()(chat)
