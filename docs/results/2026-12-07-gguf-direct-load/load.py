"""Cold and warm loads of GGUF files: seconds, peak resident memory, what the cache keeps.

Each load runs in a fresh process (`ru_maxrss` is the process's peak) with its own cache folder:
"cold" starts from an empty one (the GGUF files linked in, so nothing is downloaded), "warm" is a
second process on what the cold one kept. `--tree` runs another checkout's code (an older commit
in a git worktree) the same way.

    python load.py qwen2.5-coder-1.5b smollm2-135m [--tree /path/to/checkout] [--file some.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = """
import json, sys, time
from pathlib import Path
started = time.perf_counter()
from leapdecode.models.loading import load_model
lm = load_model(sys.argv[1], log=lambda m: None)
seconds = time.perf_counter() - started
# the peak as VmHWM (this process's own): getrusage's maxrss would keep the forking parent's
status = Path("/proc/self/status").read_text().splitlines()
peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_bytes": peak, "describe": lm.describe}))
"""


def folder_bytes(folder: Path, skip: str) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and skip not in f.parts)


def measure(spec: str, home: Path, tree: Path | None) -> dict:
    env = dict(os.environ, LEAPDECODE_HOME=str(home))
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    out = subprocess.run(  # run from the tree: `python -c` puts the working folder first on the path
        [sys.executable, "-c", LOAD, spec], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def link_presets(installed: Path, folder: Path) -> None:
    """The presets' assembled files linked into `folder`, with marks of their own saying they were
    verified there: nothing is downloaded, assembled or hashed again, and the real marks stay."""
    folder.mkdir()
    for f in installed.glob("*.gguf"):
        (folder / f.name).symlink_to(f)
    for mark in installed.glob("*.ok"):
        target = Path(mark.read_text().strip())
        (folder / mark.name).write_text(str(folder / target.name) if target.parent == installed else str(target))


def prepare_kernels(tree: Path | None) -> None:
    """Build (or find) the tree's kernels first: torch keys a built extension by its sources' paths,
    so alternating two checkouts rebuilds them, which no load should be timed with."""
    script = (
        "from leapdecode.models import lean, quantize, row_exact; quantize.kernel(); row_exact.kernel(); lean.kernel()"
    )
    env = dict(os.environ, **({"PYTHONPATH": str(tree)} if tree is not None else {}))
    subprocess.run([sys.executable, "-c", script], env=env, cwd=tree, check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("specs", nargs="+", help="presets or GGUF paths")
    parser.add_argument("--tree", type=Path, default=None, help="the checkout whose code loads (default: this one)")
    args = parser.parse_args()
    from leapdecode.models.loading import default_cache_dir

    installed = default_cache_dir() / "gguf"
    prepare_kernels(args.tree)
    for spec in args.specs:
        home = Path(tempfile.mkdtemp(prefix="load-"))
        try:
            link_presets(installed, home / "gguf")
            cold = measure(spec, home, args.tree)
            kept = folder_bytes(home, "gguf")
            warm = measure(spec, home, args.tree)
            print(json.dumps({"spec": spec, "cold": cold, "warm": warm, "kept_bytes": kept}))
        finally:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
