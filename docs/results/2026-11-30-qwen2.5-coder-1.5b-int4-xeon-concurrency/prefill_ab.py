"""The 1.5B int4's prefill (256 and 1,024 prompt tokens, ms a token, by this tree's copy of an
earlier run's `prefill.py`) with this tree's package against an earlier commit's, alternating, in
separate processes (the earlier commit in a temporary git worktree first on the import path, its
C++ kernels built in a folder of their own by an untimed first run).
Usage: python prefill_ab.py COMMIT [ROUNDS]"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = "docs/results/2026-11-27-qwen2.5-coder-1.5b-int4-forward-cost-huge-pages/prefill.py"


def prefill(tree: Path) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if tree != REPO:  # torch rebuilds a kernel whose sources moved: each tree keeps its own builds
        env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "extensions")
    done = subprocess.run(
        [sys.executable, str(REPO / SCRIPT)], env=env, capture_output=True, text=True, check=True, cwd=tree
    )
    return {
        int(n): float(ms) for n, ms in re.findall(r"prefill (\d+) tokens: [\d.]+ s, ([\d.]+) ms a token", done.stdout)
    }


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    earlier = Path(tempfile.mkdtemp(prefix="leapdecode-earlier-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(earlier), commit], check=True)
    trees = {commit: earlier, "this tree": REPO}
    try:
        prefill(earlier)  # untimed: builds the earlier tree's kernels
        for r in range(rounds):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                ms = prefill(trees[name])
                print(
                    f"round {r + 1} {name:>10}: " + "  ".join(f"{n} tokens {v:.2f} ms a token" for n, v in ms.items()),
                    flush=True,
                )
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=True)


if __name__ == "__main__":
    main()
