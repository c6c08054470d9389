"""The 1.5B int4's lean pass with this tree's kernels against a base commit's, alternating in one
process: chains of 1-8 tokens (or the ROWS given) after 300 cached ones, median of 12 passes each,
and whether the two give the same logits bit for bit.

    python lean_pass_ab.py BASE_COMMIT [ROWS, e.g. 16,64]

The base commit's `lean.cpp`, `quant.cpp` and `row_exact.cpp` are built as a second extension
and swapped into the same backend's lean forward.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from leapdecode.engine.backend import TorchBackend
from leapdecode.models import load_model

CONTEXT, REPEATS = 300, 12
SOURCES = ("lean.cpp", "quant.cpp", "row_exact.cpp", "simd.h")


def base_module(commit: str) -> object:
    """The lean extension as `commit` had it."""
    folder = Path(tempfile.mkdtemp())
    for name in SOURCES:
        text = subprocess.run(
            ["git", "show", f"{commit}:leapdecode/models/{name}"], check=True, capture_output=True, text=True
        ).stdout
        (folder / name).write_text(text)
    return load(
        name=f"leapdecode_lean_{commit[:8]}",
        sources=[str(folder / name) for name in SOURCES[:3]],
        extra_cflags=["-O3", "-fopenmp", "-DLEAPDECODE_NO_MODULE"],
        extra_ldflags=["-fopenmp"],
    )


def main() -> None:
    torch.set_num_threads(2)
    old = base_module(sys.argv[1])
    lm = load_model("qwen2.5-coder-1.5b", log=lambda message: None)
    backend = TorchBackend(lm.model, exact_tokens=lm.exact_tokens)
    assert backend.lean is not None and backend.lean.native is not None, backend.lean_reason
    forwards = {"base": dataclasses.replace(backend.lean.native, module=old), "this tree": backend.lean.native}
    print(f"| rows | {sys.argv[1][:8]}, ms | this tree, ms | ratio | same logits |")
    print("|---:|---:|---:|---:|---|")
    with torch.inference_mode():
        seq, _ = backend.prefill([1000 + (i * 37) % 20000 for i in range(CONTEXT)])
        for rows in [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else (1, 2, 4, 8):
            tokens = [1234 + i for i in range(rows)]
            times: dict[str, list[float]] = {name: [] for name in forwards}
            logits = {}
            for _ in range(REPEATS):
                for name, native in forwards.items():
                    backend.lean.native = native
                    start = time.perf_counter()
                    logits[name] = backend.forward(seq, tokens).logits
                    times[name].append(time.perf_counter() - start)
                    backend.rollback(seq, CONTEXT)
            base, new = (sorted(times[name])[REPEATS // 2] * 1e3 for name in forwards)
            same = torch.equal(logits["base"], logits["this tree"])
            print(f"| {rows} | {base:.1f} | {new:.1f} | {new / base:.3f} | {same} |")


if __name__ == "__main__":
    main()
