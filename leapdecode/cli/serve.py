"""`leapdecode serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from typing import Annotated

import typer

from leapdecode.cli.common import DEFAULT_MODEL, BackendOpt, MethodOpt, ModelOpt, console, friendly, load_with_progress, set_threads
from leapdecode.methods import parse_method


@friendly
def serve(
    model: ModelOpt = DEFAULT_MODEL,
    method: MethodOpt = "anpd",
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8000,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests admitted at once (running + waiting); more get 429.")] = 8,
    timeout: Annotated[float, typer.Option("--timeout", help="Per-request time limit in seconds (503 beyond it).")] = 120.0,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id clients use (default: --model).")] = None,
    threads: Annotated[int, typer.Option("--threads", help="Torch CPU threads (0: default).")] = 0,
    backend: BackendOpt = "torch",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    import uvicorn

    from leapdecode.server.app import ServerConfig, create_app

    parse_method(method)
    if max_queue < 1 or timeout <= 0:
        raise typer.BadParameter("--max-queue must be >= 1 and --timeout > 0")
    set_threads(threads)
    lm = load_with_progress(model, backend=backend)
    config = ServerConfig(model_name=served_model_name or lm.name, default_method=method, max_queue=max_queue, timeout_s=timeout)
    console.print(f"serving [bold]{config.model_name}[/] with [bold]{method}[/] on http://{host}:{port}/v1")
    uvicorn.run(create_app(lm, config), host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command()(serve)
