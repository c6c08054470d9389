"""`leapdecode generate` and `leapdecode serve` on the 1.5B's default path (the 0.5B drafting),
and plain `generate --method ar`, with this tree's code against an earlier commit's, alternating.

The earlier commit is checked out in a temporary git worktree and put first on the import path,
so both run with the same venv, models and kept costs (the user's cache folder, warm: run any
`generate` once before); its C++ kernels are built in a folder of its own, before the rounds. Generate: a 24-token chat answer, wall time of the whole command; serve:
seconds until /health answers. Usage: python gc_ab.py COMMIT [ROUNDS]"""

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
MODEL, PROMPT = "qwen2.5-coder-1.5b", "Write a haiku about the sea."


def command(tree: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", "from leapdecode.cli import main; main()", *args]


def env_for(tree: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if tree != REPO:  # torch rebuilds a kernel whose sources moved: each tree keeps its own builds
        env["TORCH_EXTENSIONS_DIR"] = str(tree.parent / "extensions")
    return env


def generate(tree: Path, *method: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        command(tree, "generate", "-m", MODEL, PROMPT, "-n", "24", "--chat", "--threads", "2", *method),
        env=env_for(tree), capture_output=True, text=True, check=True, cwd=tree,
    )
    return time.perf_counter() - start


def serve(tree: Path) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command(tree, "serve", "-m", MODEL, "--port", str(port), "--threads", "2"),
        env=env_for(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("the server exited")
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    earlier = Path(tempfile.mkdtemp(prefix="leapdecode-earlier-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(earlier), commit], check=True)
    trees = {commit: earlier, "this tree": REPO}
    times: dict[str, dict[str, list[float]]] = {name: {"default": [], "ar": [], "serve": []} for name in trees}
    try:
        for tree in trees.values():  # untimed: builds the earlier tree's kernels
            generate(tree)
        for r in range(rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                tree = trees[name]
                times[name]["default"].append(generate(tree))
                times[name]["ar"].append(generate(tree, "--method", "ar"))
                times[name]["serve"].append(serve(tree))
            print(f"round {r + 1}: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times[n].items()) for n in trees), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=True)
    print("\n| seconds (median of %d) | `generate`, default path | `generate --method ar` | `serve` to /health |" % rounds)
    print("|---|---:|---:|---:|")
    for name in trees:
        med = {k: sorted(v)[len(v) // 2] for k, v in times[name].items()}
        print(f"| {name} | {med['default']:.1f} | {med['ar']:.1f} | {med['serve']:.1f} |")


if __name__ == "__main__":
    main()
