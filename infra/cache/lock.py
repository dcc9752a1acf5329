"""One writer per cache: an advisory lock on OUT/.latentforge.lock, released when the process ends."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from infra.errors import ConflictError

LOCK_NAME = ".latentforge.lock"


@contextlib.contextmanager
def out_lock(out: Path) -> Iterator[None]:
    """Hold the cache's writer lock; a second writer gets a ConflictError at once."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            raise ConflictError(f"{out} is being written by another run (pid {holder or '?'})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
