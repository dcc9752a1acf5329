"""Atomic local writes: temp file in the same directory, fsync, then link/rename into place.

A crash at any point leaves either the old state or the whole new file, never a partial one under
the final name. Without `replace=True` the final step is a hard link, which fails if the name
exists, so even a racing writer cannot clobber an existing file.

Below an OUT in an object store (`infra.outstore.StoreOut`) the file is spooled in memory and sent in one PUT when
the block ends: a conditional put (``If-None-Match: *``) without `replace`, so a racing writer cannot clobber an
object either; an object appears whole or not at all. A put the store wrote but whose answer was lost is retried by
the client and meets its own object: one that holds these very bytes is taken as written (`StoreOut.put`'s
`same_ok`), any other is FileExistsError.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from infra import outdir
from infra.errors import DiskFull, OutNotWritable
from infra.faults import fault_point
from infra.outstore import StoreOut

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".lftmp"
#: Errors that mean "this file system is full" (EDQUOT: a quota, as full for this user).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: Errors that mean "this place refuses writes" (a read-only file system, a folder without write permission).
NOT_WRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)

#: Temp files being written now, as (their folder's descriptor, their name, the path shown): removed by
#: `discard_in_flight` when a second signal ends the process at once.
_in_flight: set[tuple[int, str, Path]] = set()
_in_flight_lock = threading.Lock()


@dataclass(frozen=True)
class Written:
    """What an atomic write put on disk."""

    path: Path | StoreOut  # a local path, or the object's URL below a StoreOut
    bytes: int
    sha256: str


def _fsync_dir(fd: int, directory: Path) -> None:
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic
        logger.debug("fsync of directory %s not supported", directory)


def is_disk_full(exc: BaseException) -> bool:
    """An OSError of a full file system (or quota)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def disk_full(path: Path, exc: OSError) -> DiskFull:
    """The DiskFull error for a write to `path` that hit ENOSPC (callers that know OUT add its size)."""
    return DiskFull(f"no space left on the file system of {path} ({exc.strerror})", str(path))


def not_writable(path: Path, exc: OSError) -> OutNotWritable:
    """The OutNotWritable error for a write to `path` refused by its file system or folder (EROFS, EACCES, EPERM)."""
    return OutNotWritable(f"cannot write {path} ({exc.strerror})", str(path))


class AtomicFile:
    """A file being written under a temp name: bytes are counted and hashed as they go (`write`)."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self.bytes = 0
        self.written: Written | None = None  # set once the file is in place
        self.disk_full: OSError | None = None  # an ENOSPC seen here, even if a caller (torch) re-raised it as another

    def write(self, data: bytes) -> int:
        try:
            self._fh.write(data)
        except OSError as exc:
            if is_disk_full(exc):
                self.disk_full = exc
            raise
        self._hash.update(data)
        self.bytes += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


@contextlib.contextmanager
def _folder(parent: str | Path, out: Path | None) -> Iterator[int]:
    """The descriptor of the folder `parent`, made where missing: below `out` through the door (never through a
    link), else as named."""
    if out is not None:
        with outdir.directory(out, parent, create=True) as fd:
            yield fd
        return
    Path(parent).mkdir(parents=True, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


#: The bytes a file below a StoreOut keeps in memory; past them it is spooled to a local temp file and sent from it
#: (a shard format's part, webdataset or parquet, can be GiBs; a per-sample file stays in memory, as it was).
SPOOL_IN_MEMORY = 64 << 20


class _Spool:
    """A file's bytes before its PUT: in memory up to `SPOOL_IN_MEMORY`, then in an anonymous temp file (the
    process's TMPDIR, its own scratch: a worker that shares no disk has one; gone when closed or the process ends)."""

    def __init__(self) -> None:
        self._memory: io.BytesIO | None = io.BytesIO()
        self._file: BinaryIO | None = None

    def write(self, data: bytes) -> int:
        if self._memory is not None and self._memory.tell() + len(data) > SPOOL_IN_MEMORY:
            self._file = tempfile.TemporaryFile(prefix="latentforge-put-")  # closed by `close`
            self._file.write(self._memory.getbuffer())
            self._memory = None
        return (self._memory if self._memory is not None else self._file).write(data)  # type: ignore[union-attr]

    def body(self) -> bytes | BinaryIO:
        """What the PUT sends: the bytes, or the temp file from its start."""
        if self._memory is not None:
            return self._memory.getvalue()
        assert self._file is not None
        self._file.flush()
        self._file.seek(0)
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@contextlib.contextmanager
def _store_file(out: StoreOut, path: Path | str, replace: bool) -> Iterator[AtomicFile]:
    """`atomic_file` below a StoreOut: spooled (`_Spool`), one PUT at the end (conditional unless `replace`)."""
    rel = "/".join(outdir.parts(path))
    outdir.split(rel)
    spool = _Spool()
    try:
        handle = AtomicFile(spool)  # type: ignore[arg-type]
        yield handle
        fault_point("write")
        out.put(rel, spool.body(), create=not replace, same_ok=True)
    finally:
        spool.close()
    handle.written = Written(out / rel, handle.bytes, handle.sha256)


@contextlib.contextmanager
def atomic_file(path: Path | str, *, replace: bool = False, out: Path | StoreOut | None = None) -> Iterator[AtomicFile]:
    """Stream a file into place atomically: written to a temp file in the same directory, fsynced, then linked
    (or, with `replace`, renamed) to `path` when the block ends without an error. Raises FileExistsError when
    `path` exists and not `replace`, DiskFull when the file system is full (ENOSPC, EDQUOT); on an error nothing
    appears at `path` and the temp file is gone. ``.written`` is set at the end (its path under `out` where given).

    With `out`, `path` is OUT-relative and goes through the door (`infra.outdir`): its folder is reached component
    by component without following a link, and the temp file, the link and the rename all happen inside that
    folder's descriptor, so a link swapped in meanwhile is never written through (UnsafePath).
    Below a StoreOut: one PUT when the block ends (a conditional put without `replace`: FileExistsError for an
    object there)."""
    if isinstance(out, StoreOut):
        with _store_file(out, path, replace) as handle:
            yield handle
        return
    parent, name = outdir.split(path) if out is not None else (Path(path).parent, Path(path).name)
    shown = Path(out, path) if out is not None else Path(path)
    tmp = f".{name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"
    handle: AtomicFile | None = None
    try:
        with _folder(parent, out) as folder:
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, 0o644, dir_fd=folder)
                with _in_flight_lock:
                    _in_flight.add((folder, tmp, shown))
                with os.fdopen(fd, "wb") as fh:
                    handle = AtomicFile(fh)
                    yield handle
                    fh.flush()
                    os.fsync(fh.fileno())
                fault_point("write")
                _put(folder, tmp, name, shown, replace)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=folder)
                with _in_flight_lock:
                    _in_flight.discard((folder, tmp, shown))
            _fsync_dir(folder, shown.parent)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full(shown, exc) from exc
        if exc.errno in NOT_WRITABLE_ERRNOS:  # a read-only file system or folder: every later write there fails too
            raise not_writable(shown.parent, exc) from exc
        raise
    except Exception as exc:
        if handle is not None and handle.disk_full is not None:  # ENOSPC re-raised by the caller as another error
            raise disk_full(shown, handle.disk_full) from exc
        raise
    handle.written = Written(shown, handle.bytes, handle.sha256)


def _put(folder: int, tmp: str, name: str, shown: Path, replace: bool) -> None:
    """The temp file to its name, inside `folder`: renamed over it (`replace`; a link there is refused, not replaced),
    or linked without clobbering."""
    if not replace:
        _link_no_clobber(folder, tmp, name, shown)
        return
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
            raise outdir.UnsafePath(f"{shown} is a symbolic link: not replaced (latentforge writes through no link)")
    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)


def atomic_write(
    path: Path | str, data: bytes, *, replace: bool = False, out: Path | StoreOut | None = None
) -> Written:
    """Write `data` to `path` atomically (OUT-relative and through the door with `out`). Raises FileExistsError if it
    exists and not `replace`."""
    with atomic_file(path, replace=replace, out=out) as fh:
        fh.write(data)
    assert fh.written is not None
    return fh.written


def discard_in_flight() -> int:
    """Remove the temp files being written now (the process is about to end at once); returns how many."""
    with _in_flight_lock:
        temps = list(_in_flight)
        _in_flight.clear()
    for folder, tmp, _ in temps:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
    return len(temps)


def _link_no_clobber(folder: int, tmp: str, name: str, shown: Path) -> None:
    try:
        os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
    except FileExistsError:
        raise FileExistsError(f"{shown} exists: not overwriting it") from None
    except OSError:  # no hard links here (some network or FUSE file systems)
        with contextlib.suppress(FileNotFoundError):
            os.stat(name, dir_fd=folder, follow_symlinks=False)
            raise FileExistsError(f"{shown} exists: not overwriting it") from None
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)


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


def remove_stale_temps(root: Path | StoreOut) -> int:
    """Remove temp files a killed writer left under `root` (a walk inside descriptors that follows no link). Call
    only while holding the OUT lock. A store has none (an object appears whole, in one PUT)."""
    if isinstance(root, StoreOut):
        return 0
    removed = 0
    with outdir.directory(root) as top:  # OUT itself as named; below it, no link is followed
        for _, _, names, folder in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            for name in names:
                if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=folder)
                        removed += 1
    return removed


def sha256_file(path: Path) -> str:
    """sha256 of a file, streamed."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
