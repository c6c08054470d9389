"""Giving freed memory back to the system when the server goes idle.

A request's KV cache grows in buffers of many sizes, and glibc's allocator serves large ones from
its heap once freed blocks of that size have been seen. A long-lived block (a kept prefix, say)
allocated above freed ones then pins them: resident memory stays at the busiest moment's level
long after the requests that needed it have ended. `malloc_trim` returns those free pages.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("leapdecode")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols, libc's among them
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system; whether any were returned (False where
    the C library cannot, or the call failed: it only ever saves memory)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    start = time.perf_counter()
    try:
        released = bool(trim(0))
    except Exception:  # noqa: BLE001 - never worth stopping the worker thread for
        logger.exception("giving freed memory back failed")
        return False
    logger.debug("gave freed memory back in %.0f ms", 1000 * (time.perf_counter() - start))
    return released
