"""What every command shares: options, consoles, error reporting, model loading with progress.

Imports no torch: `leapdecode --help` and `leapdecode methods` must stay fast.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from leapdecode.errors import LeapDecodeError
from leapdecode.models.presets import DEFAULT_MODEL

if TYPE_CHECKING:
    from leapdecode.engine import Step
    from leapdecode.models import LoadedModel

__all__ = [
    "DEFAULT_MODEL",
    "BackendOpt",
    "ChatOpt",
    "MaxNewOpt",
    "MethodOpt",
    "DefaultMethodOpt",
    "chosen_method",
    "ModelOpt",
    "PromptArg",
    "ThreadsOpt",
    "console",
    "DtypeOpt",
    "QuantizeOpt",
    "RowExactOpt",
    "err_console",
    "fail",
    "friendly",
    "load_with_progress",
    "print_stream",
    "read_prompt",
    "set_threads",
]

console = Console()  # standard output: the generated text and the tables a command exists to print
err_console = Console(stderr=True)  # progress, logs and errors

T = TypeVar("T")

PromptArg = Annotated[str | None, typer.Argument(help="The prompt; '-' reads standard input.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name, hub id, local folder or .gguf file.")]
MethodOpt = Annotated[
    str, typer.Option("--method", help="Method string, e.g. anpd:n=5,k=7 (see `leapdecode methods`).")
]
DefaultMethodOpt = Annotated[
    str | None,
    typer.Option(
        "--method",
        help=(
            "Method string, e.g. anpd:n=5,k=7 (see `leapdecode methods`); default: the model's fastest lossless "
            "path (its preset's draft model where installed, else anpd)."
        ),
    ),
]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most new tokens to generate.")]
ChatOpt = Annotated[bool, typer.Option("--chat/--raw", help="Apply the model's chat template to the prompt.")]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend", help="What runs the model: torch, or llama.cpp (GGUF presets and files; the llamacpp extra)."
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help=(
            "auto, float32, bfloat16 or float16. auto: a GGUF runs its own quantized blocks; a checkpoint its own "
            "dtype where the hardware computes it natively, else float32. A dtype alone runs unquantized."
        ),
    ),
]
QuantizeOpt = Annotated[
    str,
    typer.Option(
        "--quantize",
        help=(
            "auto, none, int8 or int4: group-quantized linear layers on CPU for the torch backend (auto: a GGUF's own "
            "blocks, a checkpoint unquantized; int4 keeps the LM head at int8 or a GGUF's 6 bits); rows stay bit-exact."
        ),
    ),
]
RowExactOpt = Annotated[
    bool | None,
    typer.Option(
        "--row-exact/--no-row-exact",
        help=(
            "Score every row of a verification pass bit-identically to a one-token pass: lossless by construction "
            "(default: on for float32 on CPU, and bfloat16 on CPUs with AVX512-BF16, when its kernel builds)."
        ),
        show_default=False,
    ),
]
ThreadsOpt = Annotated[int, typer.Option("--threads", help="Torch CPU threads (0: leave torch's default).")]


def log_to_stderr() -> None:
    """Send the `leapdecode` logger's progress lines to standard error (stdout carries only results)."""
    logger = logging.getLogger("leapdecode")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(console=err_console, show_path=False, markup=False))
        logger.setLevel(logging.INFO)
        logger.propagate = False


def fail(exc: LeapDecodeError) -> None:
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}")  # a message may hold brackets (`leapdecode[vllm]`)
    raise typer.Exit(2)


def friendly(fn: Callable[..., T]) -> Callable[..., T]:
    """Report a LeapDecodeError as one red line and exit status 2, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        log_to_stderr()
        try:
            return fn(*args, **kwargs)
        except LeapDecodeError as exc:
            fail(exc)
            raise  # unreachable: fail exits

    return wrapper


def set_threads(threads: int) -> None:
    if threads < 0:
        fail(LeapDecodeError(f"--threads must be >= 0, got {threads}"))
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_with_progress(
    spec: str,
    backend: str = "torch",
    dtype: str = "auto",
    row_exact: bool | None = None,
    quantize: str = "auto",
) -> LoadedModel:
    from leapdecode.gc_pause import gc_paused

    with gc_paused(), err_console.status(f"loading {spec} ...", spinner="dots") as status:
        from leapdecode.models import load_model  # imported in the pause: torch's import builds many objects too

        def log(msg: str) -> None:
            status.update(msg)
            err_console.log(msg)

        lm = load_model(spec, log=log, backend=backend, dtype=dtype, row_exact=row_exact, quantize=quantize)
        err_console.log(f"{lm.name} runs on {lm.describe}")
    # a command loads its models once: what they hold lives as long as the process, so no later
    # collection (nor the one at exit) needs to walk it again
    gc.freeze()
    return lm


def read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            fail(LeapDecodeError("no prompt given: pass it as an argument, or '-' to read standard input"))
        return sys.stdin.read()
    return prompt


def chosen_method(lm: LoadedModel, method: str | None) -> str:
    """`method`, or where none was named the model's default (`methods.defaults`), said on stderr."""
    from leapdecode.methods.defaults import default_method

    if method is not None:
        return method
    choice = default_method(lm)
    err_console.print(f"[dim]method: {choice.method} ({choice.reason})[/]")
    return choice.method


def print_stream(tokenizer: Any, steps: Iterable[Step]) -> list[Step]:
    """Print a generation's text as its steps arrive (standard output keeps only the text), and
    return the steps."""
    from leapdecode.textstream import TextStream

    text = TextStream(tokenizer)
    done = []
    for step in steps:
        done.append(step)
        console.out(text.push(step.tokens), end="", highlight=False)
    console.out(text.flush(), highlight=False)
    return done


DatasetOpt = Annotated[
    str, typer.Option("--dataset", "-d", help="humaneval, spec-bench, spec-bench:CATEGORY, a JSONL file; join with +.")
]
LimitOpt = Annotated[
    str, typer.Option("--limit", help="Prompts per category: N, or N,CATEGORY=M,... (e.g. 10,humaneval=30).")
]
OutOpt = Annotated[Path, typer.Option("--out", help="Output folder.")]
BenchThreadsOpt = Annotated[
    int,
    typer.Option("--threads", help="Torch CPU threads for every method (0: all cores, or OMP_NUM_THREADS where set)."),
]
