"""`leapdecode forward-cost` on the 1.5B int4 (chains of 1, 8, 16 and 64 rows after 300 cached
tokens) with this tree's code against an earlier commit's, alternating, in separate processes.

The earlier commit is checked out in a temporary git worktree and put first on the import path,
so both run with the same venv and models; its C++ kernels are built in a folder of their own (an
untimed first run). `prefill_ab.py` alternates the same way (`alternate`, `env_for`).
Usage: python fc_ab.py COMMIT [ROUNDS]"""

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROWS = (1, 8, 16, 64)


def env_for(tree: Path) -> dict[str, str]:
    """The environment that runs `tree`'s package."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if tree != REPO:  # torch rebuilds a kernel whose sources moved: each tree keeps its own builds
        env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "extensions")
    return env


def forward_cost(tree: Path) -> dict[int, float]:
    args = ["forward-cost", "-m", "qwen2.5-coder-1.5b", "--threads", "2", "--repeats", "5"]
    args += ["--tokens", ",".join(map(str, ROWS)), "--row-exact"]
    done = subprocess.run(
        [sys.executable, "-c", "from leapdecode.cli import main; main()", *args],
        env={**env_for(tree), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    found = {int(n): float(ms) for n, ms in re.findall(r"^\s*(\d+)\s+│?\s*(\d+) \(", done.stdout, re.M)}
    return {n: found[n] for n in ROWS}


def alternate(
    commit: str, rounds: int, measure: Callable[[Path], dict[int, float]], show: Callable[[int, float], str]
) -> None:
    """`measure` on a worktree of `commit` and on this tree, alternating (the order turning each
    round), after one untimed run of the earlier tree; a line a run, each figure as `show` puts it."""
    earlier = Path(tempfile.mkdtemp(prefix="leapdecode-earlier-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(earlier), commit], check=True)
    trees = {commit: earlier, "this tree": REPO}
    try:
        measure(earlier)  # untimed: builds the earlier tree's kernels
        for r in range(rounds):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                figures = measure(trees[name])
                print(f"round {r + 1} {name:>10}: " + "  ".join(show(n, v) for n, v in figures.items()), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=True)


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    alternate(commit, rounds, forward_cost, lambda n, ms: f"{n} rows {ms:.0f} ms")


if __name__ == "__main__":
    main()
