"""The C++ kernels are built once per what they depend on: a later process (a second server
start) and another checkout of the same sources load the build; a changed source or macro gets a
folder of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from leapdecode.models import extensions

LOAD = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
    "from leapdecode.models import quantize, row_exact; assert quantize.kernel() is not None; "
    "assert row_exact.kernel() is not None"
)


def built(name: str) -> Path:
    """Where `extensions.build` keeps the kernel `name` built from this checkout's sources."""
    from torch.utils import cpp_extension

    module = f"leapdecode_{name}_{extensions.build_key(name)}"
    return Path(cpp_extension.get_default_build_root()) / "leapdecode" / module / f"{module}.so"


def test_a_second_process_loads_the_kernels_and_builds_nothing() -> None:
    first = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    stamps = {name: built(name).stat().st_mtime_ns for name in ("quant", "row_exact")}
    second = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "building the" not in second.stdout + second.stderr  # a build says why; none here
    assert {name: built(name).stat().st_mtime_ns for name in stamps} == stamps  # nor silently


def test_the_build_key_follows_sources_and_macros_not_paths() -> None:
    key = extensions.build_key("quant")
    assert key == extensions.build_key("quant")  # the same sources, the same build
    assert key != extensions.build_key("quant", ("LEAPDECODE_NO_MODULE",))  # other macros: a build of its own
    assert key != extensions.build_key("row_exact")
