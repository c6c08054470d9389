"""Giving freed memory back to the system when the server goes idle.

A request's KV cache grows in buffers of many sizes, and glibc's allocator serves large ones from
its heap once freed blocks of that size have been seen. A long-lived block (a kept prefix, say)
allocated above freed ones then pins them: resident memory stays at the busiest moment's level
long after the requests that needed it have ended. `malloc_trim` returns those free pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

logger = logging.getLogger("leapdecode")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system; whether any were returned (False where
    the C library cannot)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
