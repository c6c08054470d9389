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

A busy minute must not steer every later run: a curve whose repeats spread wide (`ForwardCost.spread`
past `WIDE_SPREAD`: other work slowed more than one round) is measured again, up to `ATTEMPTS`
times, and kept only once narrow (else used by this process alone); a kept curve older than
`MAX_AGE_S` is measured again; a live curve whose passes disagree with its shape
(`LiveCost.misshapen`) is forgotten (`forget`), so the next start measures it again.
`leapdecode costs show|clear` lists and removes them.

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

from leapdecode.engine.cost import ForwardCost

logger = logging.getLogger("leapdecode")

STORE_FORMAT = 2  # bump when what a curve means changes (how it is measured, what a key holds)
WIDE_SPREAD = 0.25  # sizes' second-fastest repeats a quarter slower than their fastest: the machine was busy
ATTEMPTS = 3  # measurements of one curve before a wide one is used unkept
MAX_AGE_S = 14 * 24 * 3600.0  # a kept curve is measured again after two weeks (a driver, a BIOS, the load)


@dataclass(frozen=True)
class CurveKey:
    """Which curve: `what` runs (the model's fingerprint and how it runs), `kind` (chains, trees, a
    shared pass over N sequences, a prefill) and the threads it was measured with."""

    what: str
    kind: str
    threads: int

    def __str__(self) -> str:
        return f"{self.what}|{self.kind}|{self.threads}"


@dataclass(frozen=True)
class KeptCurve:
    """One kept curve as `leapdecode costs show` lists it."""

    key: str
    seconds: tuple[float, ...]
    spread: float
    age_s: float


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
    """Curves (seconds by rows) in one JSON file per machine under `folder`. `clock`: seconds
    since the epoch (a curve's age)."""

    def __init__(self, folder: Path, *, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.time) -> None:
        self.folder = folder
        self.path = folder / f"{machine_id()}.json"
        self.max_age_s = max_age_s
        self.clock = clock

    def _entries(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: CurveKey, length: int = 1) -> ForwardCost | None:
        """The stored curve for `key` if it has at least `length` points, all positive, was
        measured on a quiet machine and is younger than `max_age_s`."""
        kept = self._parse(str(key), self._entries().get(str(key)))
        if kept is None or len(kept.seconds) < length:
            return None
        if kept.age_s > self.max_age_s:
            logger.info("the kept %s curve is %.0f days old: measuring it again", key.kind, kept.age_s / 86400)
            return None
        return ForwardCost(kept.seconds, kept.spread)

    def _parse(self, key: str, entry: object) -> KeptCurve | None:
        if not isinstance(entry, dict):
            return None
        seconds, spread, at = entry.get("seconds"), entry.get("spread"), entry.get("at")
        if not isinstance(seconds, list) or not seconds:
            return None
        if not all(isinstance(s, (int, float)) and s > 0 for s in seconds):
            return None
        if not isinstance(spread, (int, float)) or not 0 <= spread <= WIDE_SPREAD or not isinstance(at, (int, float)):
            return None
        return KeptCurve(key, tuple(float(s) for s in seconds), float(spread), max(0.0, self.clock() - at))

    def kept(self) -> list[KeptCurve]:
        """Every valid curve of this machine's file, oldest key first."""
        curves = (self._parse(key, entry) for key, entry in sorted(self._entries().items()))
        return [curve for curve in curves if curve is not None]

    def forget(self, key: CurveKey) -> None:
        """Drop `key`'s curve (its shape proved wrong): the next start measures it again."""
        entries = self._entries()
        if entries.pop(str(key), None) is not None:
            self._write(entries)
            logger.info(
                "the kept %s curve disagreed with the passes it priced: it is measured again next time", key.kind
            )

    def clear(self) -> int:
        """Remove this machine's file; how many curves it held."""
        count = len(self._entries())
        self.path.unlink(missing_ok=True)
        return count

    def put(self, key: CurveKey, cost: ForwardCost) -> None:
        """Keep `cost` for `key` (a failure to write is logged, never raised: the curve was
        measured and is used either way)."""
        entries, now = self._entries(), self.clock()
        entries[str(key)] = {
            "seconds": list(cost.seconds),
            "spread": round(cost.spread, 4),
            "at": now,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        }
        self._write(entries)

    def _write(self, entries: dict[str, dict[str, object]]) -> None:
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

    def curve(self, key: CurveKey, measure: Callable[[], ForwardCost], length: int = 1) -> tuple[ForwardCost, bool]:
        """The stored curve for `key` (at least `length` points), else `measure()`'s: measured
        again while its spread is wide (up to `ATTEMPTS` times, the narrowest used), kept once
        narrow. Returns the curve and whether it was stored before."""
        stored = self.get(key, length)
        if stored is not None:
            return stored, True
        best = measure()
        for _ in range(ATTEMPTS - 1):
            if best.spread <= WIDE_SPREAD:
                break
            logger.info(
                "the %s passes' repeats spread %.0f%% (the machine was busy): measuring again",
                key.kind,
                100 * best.spread,
            )
            again = measure()
            best = again if again.spread < best.spread else best
        if best.spread <= WIDE_SPREAD:
            self.put(key, best)
        else:
            logger.warning(
                "the %s passes' repeats spread %.0f%% in %d measurements (the machine is busy): the curve is used "
                "by this process, not kept",
                key.kind,
                100 * best.spread,
                ATTEMPTS,
            )
        return best, False


def default_cost_folder() -> Path:
    """Where measured costs are kept: `costs/` in leapdecode's cache folder."""
    from leapdecode.models.loading import default_cache_dir

    return default_cache_dir() / "costs"


def default_store() -> CostStore:
    return CostStore(default_cost_folder())
