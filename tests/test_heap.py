"""`infra.heap.release_freed`: pages freed inside glibc's heap (below a live block) go back to the OS."""

from __future__ import annotations

import sys

import psutil
import pytest

from infra import heap

CHUNK, COUNT = 100 * 1024, 2000  # ~200 MiB in blocks below glibc's mmap threshold: allocated inside the heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc() is None, reason="glibc's malloc_trim")
def test_freed_heap_pages_are_returned_to_the_os() -> None:
    rss = psutil.Process().memory_info
    blocks = [bytearray(b"\1" * CHUNK) for _ in range(COUNT)]
    keep = blocks[-1]  # the last block stays: the heap's top cannot shrink past it on its own
    del blocks
    held = rss().rss
    assert heap.release_freed() is True
    freed = held - rss().rss
    assert freed > COUNT * CHUNK // 2, f"only {freed / 2**20:.0f} MiB returned"
    assert keep[0] == 1
