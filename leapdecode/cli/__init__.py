"""The `leapdecode` command line (typer): one module per group of commands, registered here.

`common` holds what the commands share; no command module imports another or this package, and
none imports torch before a command runs.
"""

from __future__ import annotations

import gc

import typer

from leapdecode.cli import bench, calibrate, chat, core, costs, measure, serve, train, vllm

app = typer.Typer(
    name="leapdecode",
    help="Lossless accelerated generation for causal language models (ANPD, prompt lookup, ...).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's lines are one paragraph, reflowed to the terminal
)
for _module in (core, chat, bench, measure, costs, calibrate, serve, train, vllm):
    _module.register(app)


def main() -> None:
    try:
        app()
    finally:
        gc.freeze()  # the process ends: the collection at exit need not walk all it built
