"""The 1.5B int4's prefill (256 and 1,024 prompt tokens, ms a token, by this tree's copy of an
earlier run's `prefill.py`) with this tree's package against an earlier commit's, alternating, in
separate processes (the earlier commit in a temporary git worktree first on the import path, its
C++ kernels built in a folder of their own by an untimed first run).
Usage: python prefill_ab.py COMMIT [ROUNDS]"""

import re
import subprocess
import sys
from pathlib import Path

from leapdecode.bench.ab import REPO, alternate, env_for

SCRIPT = "docs/results/2026-11-27-qwen2.5-coder-1.5b-int4-forward-cost-huge-pages/prefill.py"


def prefill(tree: Path) -> dict[int, float]:
    """Milliseconds a prompt token by prompt length, as `SCRIPT` prints them for `tree`'s package."""
    done = subprocess.run(
        [sys.executable, str(REPO / SCRIPT)], env=env_for(tree), capture_output=True, text=True, check=True, cwd=tree
    )
    return {
        int(n): float(ms) for n, ms in re.findall(r"prefill (\d+) tokens: [\d.]+ s, ([\d.]+) ms a token", done.stdout)
    }


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    alternate(commit, rounds, prefill, lambda n, ms: f"{n} tokens {ms:.2f} ms a token")


if __name__ == "__main__":
    main()
