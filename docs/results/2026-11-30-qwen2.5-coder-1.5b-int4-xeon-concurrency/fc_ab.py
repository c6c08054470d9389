"""`leapdecode forward-cost` on the 1.5B int4 (chains of 1, 8, 16 and 64 rows after 300 cached
tokens) with this tree's code against an earlier commit's, alternating, in separate processes.

The earlier commit is checked out in a temporary git worktree and put first on the import path,
so both run with the same venv and models; its C++ kernels are built in a folder of their own (an
untimed first run). Usage: python fc_ab.py COMMIT [ROUNDS]"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROWS = (1, 8, 16, 64)


def forward_cost(tree: Path) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if tree != REPO:  # torch rebuilds a kernel whose sources moved: each tree keeps its own builds
        env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "extensions")
    args = ["forward-cost", "-m", "qwen2.5-coder-1.5b", "--threads", "2", "--repeats", "5"]
    args += ["--tokens", ",".join(map(str, ROWS)), "--row-exact"]
    done = subprocess.run(
        [sys.executable, "-c", "from leapdecode.cli import main; main()", *args],
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    found = {int(n): float(ms) for n, ms in re.findall(r"^\s*(\d+)\s+│?\s*(\d+) \(", done.stdout, re.M)}
    return {n: found[n] for n in ROWS}


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    earlier = Path(tempfile.mkdtemp(prefix="leapdecode-earlier-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(earlier), commit], check=True)
    trees = {commit: earlier, "this tree": REPO}
    try:
        forward_cost(earlier)  # untimed: builds the earlier tree's kernels
        for r in range(rounds):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                ms = forward_cost(trees[name])
                print(f"round {r + 1} {name:>10}: " + "  ".join(f"{n} rows {ms[n]:.0f} ms" for n in ROWS), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=True)


if __name__ == "__main__":
    main()
