"""Measured pass costs kept on disk, per machine: what a decoder measures at load (its target's
cost curve, a draft model's passes and prefill, a shared pass by its rows), measured once and read
back by later processes.

Measuring takes seconds a curve (on two cores, about 12 s for the 1.5B's chains and 7 s for its
draft model's curves), and a one-shot `leapdecode generate` paid it at every start. A curve is a
property of the weights, what runs them and the machine, so it is kept under a key naming all
three: the weights' fingerprint and how they run (`what`), the curve's kind, the threads, and in
the file's name the machine (its CPU, its cores, the torch and leapdecode versions, the kernels'
and the measuring code's sources). What a kept curve cannot know is the machine's load now; `engine.cost.LiveCost`
rescales it by the passes a decoder runs, as it does a fresh measurement taken in a burst.

A file that cannot be read or parsed is ignored (measured again, then rewritten); writes replace
the file whole, so a reader sees the old or the new one. Two processes writing at once may each
drop the other's new entry, which is then measured once more.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("leapdecode")

STORE_FORMAT = 1  # bump when what a curve means changes (how it is measured, what a key holds)


@dataclass(frozen=True)
class CurveKey:
    """Which curve: `what` runs (the model's fingerprint and how it runs), `kind` (chains, trees, a
    shared pass over N sequences, a prefill) and the threads it was measured with."""

    what: str
    kind: str
    threads: int

    def __str__(self) -> str:
        return f"{self.what}|{self.kind}|{self.threads}"


@functools.cache
def machine_id() -> str:
    """A short hash of what a pass's speed depends on besides the model: the CPU (its name and
    feature flags), the cores this process may use, the torch and leapdecode versions, the C++
    kernels' sources and the code that measures and fits a curve (`engine/cost_measure.py`,
    `engine/cost.py`). Computed once a process."""
    from leapdecode.models import hardware
    from leapdecode.models.hardware import cpu_flags, cpu_name

    try:
        version = importlib.metadata.version("leapdecode")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        version = "source"

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [cpu_name(), " ".join(sorted(cpu_flags())), str(cores), torch.__version__, version, str(STORE_FORMAT)]
    digest = hashlib.sha256("\n".join(parts).encode())
    kernels = Path(hardware.__file__).parent  # a changed kernel runs at its own speed
    for source in sorted([*kernels.glob("*.cpp"), *kernels.glob("*.h")]):
        digest.update(source.read_bytes())
    for measuring in ("cost_measure.py", "cost.py"):  # how a curve is measured and fitted
        digest.update(Path(__file__).with_name(measuring).read_bytes())
    return digest.hexdigest()[:16]


class CostStore:
    """Curves (seconds by rows) in one JSON file per machine under `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / f"{machine_id()}.json"

    def _entries(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: CurveKey, length: int = 1) -> tuple[float, ...] | None:
        """The stored curve for `key` if it has at least `length` points, all positive."""
        entry = self._entries().get(str(key))
        seconds = entry.get("seconds") if isinstance(entry, dict) else None
        if not isinstance(seconds, list) or len(seconds) < length:
            return None
        if not all(isinstance(s, (int, float)) and s > 0 for s in seconds):
            return None
        return tuple(float(s) for s in seconds)

    def put(self, key: CurveKey, seconds: tuple[float, ...]) -> None:
        """Keep `seconds` for `key` (a failure to write is logged, never raised: the curve was
        measured and is used either way)."""
        entries = self._entries()
        entries[str(key)] = {"seconds": list(seconds), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(prefix=self.path.name, suffix=".partial", dir=self.folder)
            partial = Path(name)
            try:
                with os.fdopen(handle, "w", encoding="utf-8") as fh:
                    json.dump(entries, fh, indent=1, sort_keys=True)
                partial.replace(self.path)  # whole: a reader sees the old file or the new one
            finally:
                partial.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not keep the measured costs in %s (%s)", self.path, exc)

    def curve(
        self, key: CurveKey, measure: Callable[[], tuple[float, ...]], length: int = 1
    ) -> tuple[tuple[float, ...], bool]:
        """The stored curve for `key` (at least `length` points), else `measure()`'s, kept.
        Returns the curve and whether it was stored before."""
        stored = self.get(key, length)
        if stored is not None:
            return stored, True
        seconds = measure()
        self.put(key, seconds)
        return seconds, False


def default_cost_folder() -> Path:
    """Where measured costs are kept: `costs/` in leapdecode's cache folder."""
    from leapdecode.models.loading import default_cache_dir

    return default_cache_dir() / "costs"


def default_store() -> CostStore:
    return CostStore(default_cost_folder())
