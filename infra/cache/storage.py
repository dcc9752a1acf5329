"""Atomic local writes: temp file in the same directory, fsync, then link/rename into place.

A crash at any point leaves either the old state or the whole new file, never a partial one under
the final name. Without `replace=True` the final step is a hard link, which fails if the name
exists, so even a racing writer cannot clobber an existing file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from infra.ops.faults import fault_point

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".lftmp"


@dataclass(frozen=True)
class Written:
    """What an atomic write put on disk."""

    path: Path
    bytes: int
    sha256: str


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic
        logger.debug("fsync of directory %s not supported", directory)
    finally:
        os.close(fd)


class AtomicFile:
    """A file being written under a temp name: bytes are counted and hashed as they go (`write`)."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self.bytes = 0
        self.written: Written | None = None  # set once the file is in place

    def write(self, data: bytes) -> int:
        self._fh.write(data)
        self._hash.update(data)
        self.bytes += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


@contextlib.contextmanager
def atomic_file(path: Path, *, replace: bool = False) -> Iterator[AtomicFile]:
    """Stream a file into place atomically: written to a temp file in the same directory, fsynced, then linked
    (or, with `replace`, renamed) to `path` when the block ends without an error. Raises FileExistsError when
    `path` exists and not `replace`; on an error nothing appears at `path`. ``.written`` is set at the end."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            handle = AtomicFile(fh)
            yield handle
            fh.flush()
            os.fsync(fh.fileno())
        fault_point("write")
        if replace:
            os.replace(tmp, path)
        else:
            _link_no_clobber(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)
    handle.written = Written(path, handle.bytes, handle.sha256)


def atomic_write(path: Path, data: bytes, *, replace: bool = False) -> Written:
    """Write `data` to `path` atomically. Raises FileExistsError if it exists and not `replace`."""
    with atomic_file(path, replace=replace) as fh:
        fh.write(data)
    assert fh.written is not None
    return fh.written


def _link_no_clobber(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} exists: not overwriting it") from None
    except OSError:  # no hard links here (some network or FUSE file systems)
        if path.exists():
            raise FileExistsError(f"{path} exists: not overwriting it") from None
        os.replace(tmp, path)


@contextlib.contextmanager
def staged_dir(out_dir: Path, what: str) -> Iterator[Path]:
    """Build a directory atomically: yields a sibling staging folder, renamed to `out_dir` when the block ends
    without an error (removed otherwise). `out_dir` must be absent or empty (FileExistsError naming `what`)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"refusing to write {what} into non-empty {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700
    try:
        yield staging
        staging.replace(out_dir)  # rename(2): fails rather than replace a directory that became non-empty
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_stale_temps(root: Path) -> int:
    """Remove temp files a killed writer left under `root`. Call only while holding the OUT lock."""
    removed = 0
    for tmp in Path(root).rglob(f".*{TEMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


def sha256_file(path: Path) -> str:
    """sha256 of a file, streamed."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
