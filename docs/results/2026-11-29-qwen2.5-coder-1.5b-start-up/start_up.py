"""How long `leapdecode generate` and `leapdecode serve` take to start on the 1.5B's default path
(the 0.5B drafting), with nothing measured before ("cold": a fresh cache folder holding only the
models) and as a later process finds it ("warm": the same folder after the cold run), beside
plain decoding (`--method ar`, which measures nothing).

Each round builds a fresh cache folder (`$LEAPDECODE_HOME`) whose model files link to the user's
cache, so no model is converted again, then runs: generate cold, generate warm, serve warm
(the cold generate measured chains, not the server's trees and shared passes: serve's first start
there is cold for those), serve again, and plain `generate --method ar`. Generate: a 24-token chat
answer, wall time of the whole command and the seconds it reports generating; serve: seconds
until /health answers. Usage: python start_up.py [ROUNDS]"""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CLI = str(Path(sys.executable).with_name("leapdecode"))
HOME = Path(os.environ.get("LEAPDECODE_HOME", Path.home() / ".cache" / "leapdecode"))
MODEL, PROMPT = "qwen2.5-coder-1.5b", "Write a haiku about the sea."


def fresh_home() -> Path:
    """A cache folder with the user's models linked in: no costs kept, no draft model rounded."""
    home = Path(tempfile.mkdtemp(prefix="leapdecode-home-"))
    for name in ("gguf", "models", "vocab"):
        if (HOME / name).exists():
            (home / name).symlink_to(HOME / name)
    (home / "quantized").mkdir()
    for saved in (HOME / "quantized").glob("*-int4-v*.safetensors"):
        if "-draft-" not in saved.name:  # the GGUF's own blocks, as any user who ran the model has them
            (home / "quantized" / saved.name).symlink_to(saved)
    return home


def generate(home: Path, *method: str) -> tuple[float, float]:
    env = {**os.environ, "LEAPDECODE_HOME": str(home)}
    start = time.perf_counter()
    out = subprocess.run(
        [CLI, "generate", "-m", MODEL, PROMPT, "-n", "24", "--chat", "--threads", "2", *method],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    decoding = float(re.search(r"tokens in ([0-9.]+) s", out.stdout + out.stderr).group(1))
    return wall, decoding


def serve(home: Path) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LEAPDECODE_HOME": str(home)}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [CLI, "serve", "-m", MODEL, "--port", str(port), "--threads", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for r in range(rounds):
    home = fresh_home()
    try:
        cold, cold_gen = generate(home)
        warm, warm_gen = generate(home)
        serve_first = serve(home)
        serve_again = serve(home)
        plain, plain_gen = generate(home, "--method", "ar")
    finally:
        shutil.rmtree(home)
    print(
        f"round {r + 1}: generate cold {cold:.1f} s ({cold_gen:.2f} s decoding), warm {warm:.1f} s "
        f"({warm_gen:.2f} s), plain ar {plain:.1f} s ({plain_gen:.2f} s); serve first {serve_first:.1f} s, "
        f"again {serve_again:.1f} s",
        flush=True,
    )
