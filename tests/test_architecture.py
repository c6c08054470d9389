"""The package's shape, as docs/ARCHITECTURE.md states it: layers, no import cycles, a light CLI,
and a registry in which every method is complete."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leapdecode.methods import DRAFT_SHAPES, METHODS, Method, parse_method
from tests.helpers import length_parameter

PACKAGE = Path(__file__).resolve().parents[1] / "leapdecode"

# docs/ARCHITECTURE.md: a module may import from its own layer or the layers below it.
LAYERS = {
    "errors": 0,
    "textstream": 0,
    "data": 0,
    "choices": 0,
    "gc_pause": 0,
    "models": 1,
    "engine": 2,
    "early_exit": 3,
    "verifiers": 3,
    "heads": 3,
    "drafters": 4,
    "methods": 5,
    "api": 6,
    "request": 6,
    "bench": 7,
    "server": 7,
    "integrations": 7,
    "training": 7,
    "cli": 8,
    "__main__": 8,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Every leapdecode module `module` imports, at the top, inside functions, or only for type
    checkers (`if TYPE_CHECKING:`): a type is a dependency too."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("leapdecode"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("leapdecode"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_sits_in_a_layer_and_imports_only_downwards() -> None:
    graph = _graph()
    unplaced = [m for m in graph if m != "leapdecode" and _layer(m) is None]
    assert not unplaced, f"modules outside the layers of docs/ARCHITECTURE.md: {unplaced}"
    upward = [
        f"{m} ({_layer(m)}) imports {dep} ({_layer(dep)})"
        for m, deps in graph.items()
        if m != "leapdecode"
        for dep in deps
        if dep != "leapdecode" and _layer(dep) > _layer(m)  # type: ignore[operator]
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The two checks above can fail: an import inside a function, or one made only for type
    checkers, is an import like any other."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from leapdecode.api import wrap\n")
    assert _imports(a, "leapdecode.engine.a", {"leapdecode.api", "leapdecode.engine.a"}) == {"leapdecode.api"}
    b = tmp_path / "b.py"
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from leapdecode.api import wrap\n")
    assert _imports(b, "leapdecode.engine.b", {"leapdecode.api", "leapdecode.engine.b"}) == {"leapdecode.api"}
    assert _layer("leapdecode.api") > _layer("leapdecode.engine.a")  # type: ignore[operator]


@pytest.mark.parametrize("args", [["--help"], ["methods"], ["bench", "--help"], ["models", "list"]])
def test_light_commands_import_no_torch(args: list[str]) -> None:
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom leapdecode.cli import app\n"
        f"result = CliRunner().invoke(app, {args!r})\n"
        "assert result.exit_code == 0, result.output\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO-TORCH"), f"`leapdecode {' '.join(args)}` imported torch"


# Parameters a method cannot do without, to build an example of each.
# (`draft` with its retrieval off: its longest chain is then k, else a suffix match's suffix_k)
REQUIRED = {
    "rest": "datastore=ds",
    "layerskip": "exit=2",
    "hf-assisted": "model=m",
    "draft": "suffix=false",
    "llama-cpp-spec": "model=m",
}


@pytest.mark.parametrize("cls", METHODS, ids=[m.name for m in METHODS])
def test_every_registered_method_is_complete(cls: type[Method], monkeypatch: pytest.MonkeyPatch) -> None:
    """What would have caught `pld` reporting K = 0: every chain method's draft length is its
    length parameter, the canonical string round-trips, and `leapdecode methods` lists it."""
    example = parse_method(f"{cls.name}:{REQUIRED[cls.name]}" if cls.name in REQUIRED else cls.name)
    assert type(example) is cls and cls.summary and example.drafts in DRAFT_SHAPES
    assert example.pass_size >= 1 + example.draft_length
    if example.drafts == "tree":  # a tree method says its own pass size
        assert type(example).pass_size is not Method.pass_size and example.pass_size > 1
    assert parse_method(str(example)) == example
    if example.drafts == "chain":
        assert example.draft_length == example.chain_length >= 1
        assert length_parameter(example), f"{cls.name}: its draft length is none of its integer parameters"
    else:
        assert example.draft_length == 0
    from leapdecode.cli import common

    # the table is as wide as the console: rich fixes a width read from COLUMNS when the console is
    # made, which another test's CliRunner may have set first
    monkeypatch.setattr(common.console, "_width", 200)
    listing = CliRunner().invoke(_app(), ["methods"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0 and cls.name in listing.output and cls.summary[:30] in listing.output


def test_the_draft_model_reports_its_longest_chain() -> None:
    assert parse_method("draft").draft_length == 16 and parse_method("draft:suffix_k=4,k=6").draft_length == 6
    assert (
        parse_method("draft:suffix=false").draft_length == 5
        and parse_method("draft:cost_aware=false").draft_length == 5
    )


def test_pld_reports_its_draft_length() -> None:
    assert parse_method("pld").draft_length == 10
    assert parse_method("pld:k=4,cost_aware=true").draft_length == 4


def test_a_bad_choice_is_refused_when_the_method_string_is_parsed() -> None:
    """The value lists live once (`leapdecode.choices`): parsing checks them, no torch needed."""
    from leapdecode.errors import MethodError

    for bad in (
        "draft:model=m,schedule=sometimes",
        "jacobi:mode=diagonal",
        "jacobi:init=zeros",
        "calm:measure=entropy",
    ):
        with pytest.raises(MethodError, match="must be one of"):
            parse_method(bad)


def _app():  # noqa: ANN202 - typer app
    from leapdecode.cli import app

    return app
