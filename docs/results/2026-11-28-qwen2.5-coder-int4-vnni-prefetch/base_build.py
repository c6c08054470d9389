"""One of the project's C++ extensions as a base commit had it, built beside this tree's under its own
name, for the A/B scripts in this folder."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

from torch.utils.cpp_extension import load


def extension_at(commit: str, source: str) -> Any:
    """`leapdecode/models/<source>` (with `simd.h`) as `commit` had it, compiled as its own extension."""
    folder = Path(tempfile.mkdtemp())
    sha = subprocess.run(["git", "rev-parse", commit], check=True, capture_output=True, text=True).stdout.strip()
    for name in (source, "simd.h"):
        text = subprocess.run(
            ["git", "show", f"{sha}:leapdecode/models/{name}"], check=True, capture_output=True, text=True
        ).stdout
        (folder / name).write_text(text)
    return load(
        name=f"leapdecode_{Path(source).stem}_{sha[:8]}",
        sources=[str(folder / source)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
