"""Python's cyclic garbage collector paused while a model loads.

Why: loading builds millions of small objects at once (torch's and transformers' imports, a
tokenizer's JSON vocabulary and merges, the modules' parameters), and each few hundred thousand
of them start a collection that walks every object alive; measured on a 1.5B target with its 0.5B
draft, those walks were a fifth of `leapdecode generate`'s start (`docs/benchmarks.md`). Loading
makes almost no reference cycles, so nothing waits to be freed; the collector runs again, on its
usual thresholds, once the outermost pause ends. Pauses nest, and a collector someone else
disabled stays disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # pauses open in this process, across threads
_resume = False  # whether the outermost pause found the collector on


@contextmanager
def gc_paused() -> Iterator[None]:
    """Keep the cyclic collector off inside the block (and inside every block open at the time)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
