"""The project's C++ kernels, built on first use with `torch.utils.cpp_extension` and cached
(under torch's extensions folder: later processes load them in well under a second)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger("leapdecode")


@functools.cache
def build(name: str, *sources: str, defines: tuple[str, ...] = ()) -> Any | None:
    """The compiled extension `leapdecode_<name>` from `sources` (files next to this one; with
    `defines`, macros set for each), or None (logged) when it cannot be built here (no compiler,
    no headers). A CPU without AVX2/FMA gets the kernel's portable path (logged), never a crash."""
    from torch.utils import cpp_extension

    _find_ninja()
    try:
        module = cpp_extension.load(
            name=f"leapdecode_{name}",
            sources=[str(Path(__file__).with_name(source)) for source in sources],
            extra_cflags=["-O3", "-fopenmp", *(f"-D{macro}" for macro in defines)],
            extra_ldflags=["-fopenmp"],
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
