"""`leapdecode serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from typing import Annotated

import typer

from leapdecode.cli.common import (
    DEFAULT_MODEL,
    BackendOpt,
    DefaultMethodOpt,
    DtypeOpt,
    ModelOpt,
    QuantizeOpt,
    RowExactOpt,
    chosen_method,
    console,
    err_console,
    friendly,
    load_with_progress,
    set_threads,
)
from leapdecode.methods import method_class, parse_method


@friendly
def serve(
    model: ModelOpt = DEFAULT_MODEL,
    method: DefaultMethodOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8000,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests admitted at once (running + waiting); more get 429.")
    ] = 8,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Per-request time limit in seconds (503 beyond it).")
    ] = 120.0,
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="Model id clients use (default: --model).")
    ] = None,
    threads: Annotated[int, typer.Option("--threads", help="Torch CPU threads (0: default).")] = 0,
    backend: BackendOpt = "torch",
    allow_methods: Annotated[
        str | None,
        typer.Option(
            "--allow-methods",
            help=(
                "Comma list of method names a request may choose (default: --method and the lossless methods that "
                "load no files or models)."
            ),
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="LEAPDECODE_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 requests."
        ),
    ] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host", help="Host header accepted (repeatable; default: any). Guards against DNS rebinding."
        ),
    ] = None,
    max_body_bytes: Annotated[
        int, typer.Option("--max-body-bytes", help="Largest request body accepted (413 beyond it).")
    ] = 4 << 20,
    header_timeout: Annotated[
        float,
        typer.Option(
            "--header-timeout",
            help="Seconds a request's headers may take to arrive whole (408 and the connection closed beyond it).",
        ),
    ] = 5.0,
    body_timeout: Annotated[
        float, typer.Option("--body-timeout", help="Seconds a request body may take to arrive whole (408 beyond it).")
    ] = 30.0,
    max_connections: Annotated[
        int, typer.Option("--max-connections", help="Open connections at once; more get 503.")
    ] = 64,
    dtype: DtypeOpt = "auto",
    row_exact: RowExactOpt = None,
    quantize: QuantizeOpt = "auto",
    max_batch: Annotated[
        int | None,
        typer.Option(
            "--max-batch",
            help=(
                "Requests decoded together in shared passes (1: one at a time; default: chosen from the model's "
                "measured pass cost)."
            ),
        ),
    ] = None,
    max_pass_rows: Annotated[
        int,
        typer.Option(
            "--max-pass-rows",
            help="Tokens one shared pass may score: pending, drafted and prompt tokens (at most 256).",
        ),
    ] = 128,
    prefix_cache_tokens: Annotated[
        int | None,
        typer.Option(
            "--prefix-cache-tokens",
            help=(
                "Tokens of finished requests' KV caches kept for requests that begin the same way (a chat's "
                "history, a system prompt), which then prefill only the rest; 0: off (default: 8192, or what "
                "1 GiB of keys and values holds where fewer)."
            ),
        ),
    ] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    import uvicorn

    from leapdecode.server.app import ServerConfig, create_app, is_loopback
    from leapdecode.server.http import guarded_protocol
    from leapdecode.server.middleware import allowed_hosts

    if method is not None:
        parse_method(method)
    allowed_hosts(tuple(allowed_host or ()))  # a malformed one fails before the model loads
    allowed = tuple(m.strip() for m in allow_methods.split(",") if m.strip()) if allow_methods is not None else None
    for name in allowed or ():
        method_class(name)
    if (
        max_queue < 1
        or timeout <= 0
        or max_body_bytes < 1024
        or body_timeout <= 0
        or header_timeout <= 0
        or max_connections < 1
    ):
        raise typer.BadParameter(
            "--max-queue must be >= 1, --timeout > 0, --max-body-bytes >= 1024, --body-timeout > 0, "
            "--header-timeout > 0 and --max-connections >= 1"
        )
    if (max_batch is not None and max_batch < 1) or not (max_batch or 1) <= max_pass_rows <= 256:
        raise typer.BadParameter("--max-batch must be >= 1, and --max-pass-rows from --max-batch to 256")
    if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
        raise typer.BadParameter("--prefix-cache-tokens must be >= 0 (0: no prefix cache)")
    if not is_loopback(host) and not api_key:
        err_console.print(f"[yellow]warning:[/] serving on {host}, reachable from other machines, with no --api-key")
    set_threads(threads)
    lm = load_with_progress(model, backend=backend, dtype=dtype, row_exact=row_exact, quantize=quantize)
    method = chosen_method(lm, method)
    config = ServerConfig(
        model_name=served_model_name or lm.name,
        default_method=method,
        max_queue=max_queue,
        timeout_s=timeout,
        allow_methods=allowed,
        api_key=api_key,
        allowed_hosts=tuple(allowed_host or ()),
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout,
        header_timeout_s=header_timeout,
        max_connections=max_connections,
        max_batch=max_batch,
        max_pass_rows=max_pass_rows,
        prefix_cache_tokens=prefix_cache_tokens,
    )
    console.print(f"serving [bold]{config.model_name}[/] with [bold]{method}[/] on http://{host}:{port}/v1")
    uvicorn.run(
        create_app(lm, config),
        host=host,
        port=port,
        log_level="warning",
        http=guarded_protocol(config.header_timeout_s, config.max_connections),
    )


def register(app: typer.Typer) -> None:
    app.command()(serve)
