"""`leapdecode costs show|clear`: the pass costs this machine keeps (`engine.cost_store`).

A decoder measures what its passes cost at its first load on a machine and keeps the curves for
later processes; these commands list them (what, how many points, one row and the last row, how
quiet the measurement was, how old) and remove them, so that the next load measures again.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from leapdecode.cli.common import console, friendly

costs_app = typer.Typer(help="The pass costs measured on this machine and kept for later processes.")


@friendly
def costs_show() -> None:
    """List the kept cost curves of this machine."""
    from leapdecode.engine.cost_store import default_store

    store = default_store()
    curves = store.kept()
    table = Table(title=f"kept pass costs ({store.path})")
    for column in ("model and path", "curve", "threads", "rows", "1 row ms", "last row ms", "spread", "age"):
        table.add_column(column, justify="left" if column in ("model and path", "curve") else "right")
    for curve in curves:
        what, kind, threads = curve.key.rsplit("|", 2)
        age = curve.age_s / 86400
        table.add_row(
            what,
            kind,
            threads,
            str(len(curve.seconds)),
            f"{1000 * curve.seconds[0]:.2f}",
            f"{1000 * curve.seconds[-1]:.2f}",
            f"{100 * curve.spread:.0f}%",
            f"{age:.1f} d" if age >= 1 else f"{curve.age_s / 3600:.1f} h",
        )
    console.print(table if curves else f"no kept pass costs in {store.path}")


@friendly
def costs_clear(
    every_machine: Annotated[
        bool, typer.Option("--every-machine", help="Also the curves kept for other CPUs and versions.")
    ] = False,
) -> None:
    """Remove the kept cost curves: the next load measures its passes again."""
    from leapdecode.engine.cost_store import default_store

    store = default_store()
    removed = store.clear()
    others = 0
    if every_machine:
        for other in store.folder.glob("*.json"):
            other.unlink(missing_ok=True)
            others += 1
    console.print(f"removed {removed} curves of this machine" + (f" and {others} other files" if every_machine else ""))


def register(app: typer.Typer) -> None:
    costs_app.command("show")(costs_show)
    costs_app.command("clear")(costs_clear)
    app.add_typer(costs_app, name="costs")
