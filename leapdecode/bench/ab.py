"""A/B measurements of this tree against other code: a C++ extension as another commit had it, or
as a variant of this tree's source, built beside the tree's under a name of its own (so both load
in one process and alternate); and whole runs of another commit's package in a git worktree,
alternating with this tree's in separate processes.

The scripts under `docs/results/` that record how a comparison was made share these. torch is
imported only by the functions that build an extension, so a script that only starts processes
(`alternate`) stays light.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]  # the checkout this package runs from (an editable install's)
MODELS = Path(__file__).resolve().parents[1] / "models"  # the package's C++ sources: quant.cpp, simd.h, ...


def extension_at(commit: str, source: str) -> ModuleType:
    """`leapdecode/models/<source>` (with `simd.h`) as `commit` had it, compiled as an extension of
    its own: a base commit's kernel timed against this tree's in one process, where the machine's
    state is the same for both. `commit` is resolved by git in the working folder."""
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp())
    sha = subprocess.run(["git", "rev-parse", commit], check=True, capture_output=True, text=True).stdout.strip()
    for name in (source, "simd.h"):
        text = subprocess.run(
            ["git", "show", f"{sha}:leapdecode/models/{name}"], check=True, capture_output=True, text=True
        ).stdout
        (folder / name).write_text(text)
    return load(
        name=f"leapdecode_{Path(source).stem}_{sha[:8]}",
        sources=[str(folder / source)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


def build_variant(
    module: str,
    changes: Sequence[tuple[str, str]],
    sources: tuple[str, ...] = ("quant.cpp",),
    defines: tuple[str, ...] = (),
) -> ModuleType:
    """The extension `module` built from this tree's `sources` (files beside `quant.cpp`) with
    `changes` made to `quant.cpp`, each (the tree's text, the variant's): one change to the kernel
    tried without touching the tree. A change whose text the tree no longer has fails, rather than
    timing the tree against itself. `defines` are passed as `-D` macros."""
    from torch.utils import cpp_extension

    source = MODELS / "quant.cpp"
    text = source.read_text()
    for old, new in changes:
        assert old in text, f"{module}: the tree's kernel no longer has what this variant changes"
        text = text.replace(old, new)
    folder = Path(tempfile.mkdtemp())
    for name in {*sources, "simd.h"} - {"quant.cpp"}:
        (folder / name).write_text(source.with_name(name).read_text())
    (folder / "quant.cpp").write_text(text)
    return cpp_extension.load(
        name=module,
        sources=[str(folder / name) for name in sources],
        extra_cflags=["-O3", "-fopenmp", *(f"-D{macro}" for macro in defines)],
        extra_ldflags=["-fopenmp"],
    )


def env_for(tree: Path) -> dict[str, str]:
    """The environment that runs `tree`'s package (first on the import path). A tree other than
    this one keeps its own kernel builds: torch rebuilds an extension whose sources moved, and the
    two trees would otherwise rebuild each other's on every run."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if tree != REPO:
        env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "extensions")
    return env


def command(*args: str) -> list[str]:
    """`leapdecode ARGS...` as a command line for the package on the import path (`env_for`): the
    interpreter running this script, not whichever `leapdecode` script is installed."""
    return [sys.executable, "-c", "from leapdecode.cli import main; main()", *args]


@contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """A temporary git worktree of `commit` (detached), removed on the way out: another commit's
    package run with the same venv, models and caches as this tree's."""
    earlier = Path(tempfile.mkdtemp(prefix="leapdecode-earlier-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(earlier), commit], check=True)
    try:
        yield earlier
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=True)


def alternate(
    commit: str, rounds: int, measure: Callable[[Path], dict[int, float]], show: Callable[[int, float], str]
) -> None:
    """`measure` on a worktree of `commit` and on this tree, alternating (the order turning each
    round, so neither side always runs on the machine the other left), after one untimed run of the
    earlier tree that builds its kernels; one printed line a run, each figure as `show` puts it."""
    with worktree(commit) as earlier:
        trees = {commit: earlier, "this tree": REPO}
        measure(earlier)  # untimed: builds the earlier tree's kernels
        for r in range(rounds):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                figures = measure(trees[name])
                print(f"round {r + 1} {name:>10}: " + "  ".join(show(n, v) for n, v in figures.items()), flush=True)
