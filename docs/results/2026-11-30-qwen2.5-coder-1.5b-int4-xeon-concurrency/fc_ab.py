"""`leapdecode forward-cost` on the 1.5B int4 (chains of 1, 8, 16 and 64 rows after 300 cached
tokens) with this tree's code against an earlier commit's, alternating, in separate processes.

The earlier commit is checked out in a temporary git worktree and put first on the import path,
so both run with the same venv and models; its C++ kernels are built in a folder of their own (an
untimed first run): `leapdecode.bench.ab.alternate`, which `prefill_ab.py` uses the same way.
Usage: python fc_ab.py COMMIT [ROUNDS]"""

import re
import subprocess
import sys
from pathlib import Path

from leapdecode.bench.ab import alternate, command, env_for

ROWS = (1, 8, 16, 64)


def forward_cost(tree: Path) -> dict[int, float]:
    """Milliseconds a pass by rows, as `forward-cost --row-exact` prints them for `tree`'s package."""
    args = ["forward-cost", "-m", "qwen2.5-coder-1.5b", "--threads", "2", "--repeats", "5"]
    args += ["--tokens", ",".join(map(str, ROWS)), "--row-exact"]
    done = subprocess.run(
        command(*args),
        env={**env_for(tree), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    found = {int(n): float(ms) for n, ms in re.findall(r"^\s*(\d+)\s+│?\s*(\d+) \(", done.stdout, re.M)}
    return {n: found[n] for n in ROWS}


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    alternate(commit, rounds, forward_cost, lambda n, ms: f"{n} rows {ms:.0f} ms")


if __name__ == "__main__":
    main()
