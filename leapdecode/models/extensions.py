"""The project's C++ kernels, built on first use with `torch.utils.cpp_extension` and cached
(under torch's extensions folder, `leapdecode/`, one folder per build by what it depends on:
later processes load them in well under a second)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("leapdecode")


CFLAGS = ("-O3", "-fopenmp")


def build_key(name: str, defines: tuple[str, ...] = ()) -> str:
    """What a built kernel depends on, as a short hash: every C++ source and header beside this
    file (by content, not path: two checkouts of the same sources share one build), the macros,
    the flags, torch's version and the Python version."""
    import torch

    digest = hashlib.sha256(f"{name} {defines} {CFLAGS} {torch.__version__} {sys.version_info[:2]}".encode())
    folder = Path(__file__).parent
    for source in sorted([*folder.glob("*.cpp"), *folder.glob("*.h")]):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def build(name: str, *sources: str, defines: tuple[str, ...] = ()) -> Any | None:
    """The compiled extension `leapdecode_<name>` from `sources` (files next to this one; with
    `defines`, macros set for each), or None (logged) when it cannot be built here (no compiler,
    no headers). A CPU without AVX2/FMA gets the kernel's portable path (logged), never a crash.
    Each build has a folder of its own, named by what it depends on (`build_key`): a later
    process, another checkout of the same sources or another kernel's macros never rebuild it,
    and a build that does happen says why."""
    from torch.utils import cpp_extension

    _find_ninja()
    key = build_key(name, defines)
    module_name = f"leapdecode_{name}_{key}"
    folder = Path(cpp_extension.get_default_build_root()) / "leapdecode" / module_name
    if not (folder / f"{module_name}.so").exists():
        logger.info("building the %s kernel: these sources (%s) were not built here before (minutes)", name, key)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=module_name,
            sources=[str(Path(__file__).with_name(source)) for source in sources],
            extra_cflags=[*CFLAGS, *(f"-D{macro}" for macro in defines)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, cpp_extension.CalledProcessError) as exc:
        logger.warning("the %s kernel could not be built (%s)", name, exc)
        return None
    if not module.fast_path_available():
        logger.warning("this CPU has no AVX2/FMA: the %s kernel runs its portable path", name)
    return module


def _find_ninja() -> None:
    """torch's extension builder runs `ninja` from PATH; the pip-installed one lives in the
    environment's own bin folder, which is not on PATH when Python is run by its full path."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # the `ninja` dependency
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
