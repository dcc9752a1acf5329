"""Give freed memory back to the OS between a build's steps.

A build's shard loop frees its pixel buffers and latents, but glibc keeps the freed pages in its per-thread arenas;
the next step (decode-and-verify at full size) then grows the process on top of them. `release_freed` collects
garbage and asks glibc (``malloc_trim(0)``) to return every free page it holds. Elsewhere (musl, macOS) it only
collects garbage.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed() -> bool:
    """Collect garbage, then return glibc's free pages to the OS; False where there is no ``malloc_trim``."""
    gc.collect()
    if not trim():
        return False
    logger.debug("malloc_trim(0): freed pages returned to the OS")
    return True


def trim() -> bool:
    """Return glibc's free pages to the OS without collecting garbage (a collection writes to every tracked
    object, unsharing the pages a forked process shares with its parent); False where there is no ``malloc_trim``."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
