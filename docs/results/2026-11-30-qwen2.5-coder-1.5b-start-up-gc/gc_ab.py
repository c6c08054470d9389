"""`leapdecode generate` and `leapdecode serve` on the 1.5B's default path (the 0.5B drafting),
and plain `generate --method ar`, with this tree's code against an earlier commit's, alternating.

The earlier commit is checked out in a temporary git worktree and put first on the import path,
so both run with the same venv, models and kept costs (the user's cache folder, warm: run any
`generate` once before); its C++ kernels are built in a folder of its own, before the rounds
(`leapdecode.bench.ab`). Generate: a 24-token chat answer, wall time of the whole command; serve:
seconds until /health answers. Usage: python gc_ab.py COMMIT [ROUNDS]"""

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from leapdecode.bench.ab import REPO, command, env_for, worktree

MODEL, PROMPT = "qwen2.5-coder-1.5b", "Write a haiku about the sea."


def generate(tree: Path, *method: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        command("generate", "-m", MODEL, PROMPT, "-n", "24", "--chat", "--threads", "2", *method),
        env=env_for(tree),
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    return time.perf_counter() - start


def serve(tree: Path) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command("serve", "-m", MODEL, "--port", str(port), "--threads", "2"),
        env=env_for(tree),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tree,
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
    with worktree(commit) as earlier:
        trees = {commit: earlier, "this tree": REPO}
        times: dict[str, dict[str, list[float]]] = {name: {"default": [], "ar": [], "serve": []} for name in trees}
        for tree in trees.values():  # untimed: builds the earlier tree's kernels
            generate(tree)
        for r in range(rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                tree = trees[name]
                times[name]["default"].append(generate(tree))
                times[name]["ar"].append(generate(tree, "--method", "ar"))
                times[name]["serve"].append(serve(tree))
            last = "; ".join(f"{n}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times[n].items()) for n in trees)
            print(f"round {r + 1}: {last}", flush=True)
    print(
        f"\n| seconds (median of {rounds}) | `generate`, default path | `generate --method ar` | `serve` to /health |"
    )
    print("|---|---:|---:|---:|")
    for name in trees:
        med = {k: sorted(v)[len(v) // 2] for k, v in times[name].items()}
        print(f"| {name} | {med['default']:.1f} | {med['ar']:.1f} | {med['serve']:.1f} |")


if __name__ == "__main__":
    main()
