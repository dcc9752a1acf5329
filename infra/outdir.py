"""The one door to OUT: every path below a cache root is reached from the root's own directory, one component at a
time, each opened with ``O_NOFOLLOW`` relative to its parent's descriptor (openat-style). A ``..``, an absolute
path, or a symbolic link anywhere below OUT is refused (`UnsafePath`), so nothing is read, written or uploaded
outside OUT through a ledger row, a report folder or a group folder.

Why descriptors and not ``realpath`` then ``open``: a resolved path is a promise about the moment it was resolved,
and a link swapped in before the open would be followed. Here the check is the use: each component is opened
without following a link, and the next is looked up inside the descriptor just opened, so there is no moment in
between to race. OUT itself is opened as named (a link the user names is the user's to name).

Atomic writes under OUT are `infra.storage.atomic_file(rel, out=OUT)`, which takes its folder from `directory`.

OUT may also be a URL (``s3://BUCKET/PREFIX``): `root` gives a `StoreOut` for it, and every function here takes
either (`Out`) and answers the same for an object below the URL's prefix (`infra.outstore`); the path checks are
the same, and a store has no links. `directory` and `open_fd` are local-disk only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from infra.errors import LatentforgeError
from infra.outstore import StoreOut, is_url, root

__all__ = ["Out", "OutFile", "StoreOut", "UnsafePath", "root"]

#: A folder below OUT: never through a link (ELOOP), never a file (ENOTDIR).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Every file opened below OUT: never through a link; O_NONBLOCK so that a FIFO planted there cannot hang a read
#: (a regular file ignores it).
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
Kind = Literal["file", "dir", "link", "other"]
#: OUT as the door takes it: a local folder, or a folder URL in an object store.
Out = Path | StoreOut


class UnsafePath(LatentforgeError):
    """A path under OUT the door refuses: absolute, with a ``..``, through a symbolic link, or not a regular file."""


def parts(rel: str | os.PathLike[str]) -> tuple[str, ...]:
    """The components of an OUT-relative path (``.`` and empty ones dropped); UnsafePath for an absolute path, a
    ``..`` or a NUL: such a path could name something outside OUT."""
    text = os.fspath(rel)
    if "\0" in text or text.startswith("/") or ".." in text.split("/"):
        raise UnsafePath(f"{text!r} is not a path inside OUT (absolute, '..' or a NUL byte): refused")
    return tuple(name for name in text.split("/") if name not in ("", "."))


def join(*names: str) -> str:
    """OUT-relative parts joined with ``/`` (empty ones left out): ``join("", "a")`` is ``a``."""
    return "/".join(name for name in names if name)


def split(rel: str | os.PathLike[str]) -> tuple[str, str]:
    """(the folder, the name) of an OUT-relative file path; UnsafePath as `parts`, or when it names OUT itself."""
    names = parts(rel)
    if not names:
        raise UnsafePath(f"{os.fspath(rel)!r} names OUT itself, not a file below it")
    return "/".join(names[:-1]), names[-1]


def _rel(rel: str | os.PathLike[str]) -> str:
    """An OUT-relative path checked (`parts`) and joined with ``/``: an object's name below a StoreOut."""
    return "/".join(parts(rel))


def shown(out: Out, rel: str | os.PathLike[str] = "") -> str:
    """Where `rel` below `out` is, as a message shows it (a path, or the object's URL)."""
    if isinstance(out, StoreOut):
        return str(out / _rel(rel)) if _rel(rel) else str(out)
    return str(Path(out, rel))


def of_setting(value: str) -> Out:
    """OUT as a setting (``--out``, a config's ``out``) names it: a `StoreOut` for a URL, else the local folder with
    ``~`` expanded."""
    return root(value) if is_store(value) else Path(value).expanduser()


def is_store(out: object) -> bool:
    """Whether `out` is OUT in an object store (a StoreOut, or a URL)."""
    return isinstance(out, StoreOut) or (isinstance(out, str) and is_url(out))


def _local(out: Out, what: str) -> Path:
    if isinstance(out, StoreOut):
        raise TypeError(f"{what} is a local-disk operation: {out} is in an object store")
    return Path(out)


def _link(out: Path, names: tuple[str, ...]) -> UnsafePath:
    shown = Path(out, *names)
    return UnsafePath(
        f"{shown} is a symbolic link: latentforge never reads, writes or uploads under OUT through a link "
        "(replace it with the real folder or file)"
    )


def _refusal(fd: int, name: str, out: Path, names: tuple[str, ...], exc: OSError) -> OSError:
    """What an open below OUT that failed with ELOOP / ENOTDIR means: a link (UnsafePath) or a file in the way."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                return _link(out, names)
    return exc


def _child(fd: int, name: str, create: bool) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):  # made by a racing writer meanwhile: opened below, never followed
        os.mkdir(name, 0o755, dir_fd=fd)
    return os.open(name, _DIR_FLAGS, dir_fd=fd)


@contextlib.contextmanager
def directory(out: Out, rel: str | os.PathLike[str] = "", *, create: bool = False) -> Iterator[int]:
    """A descriptor of the folder `rel` below `out`, reached without following a link (`create`: made where
    missing, OUT included). UnsafePath for a link on the way; FileNotFoundError / NotADirectoryError otherwise."""
    names = parts(rel)
    out = _local(out, "a folder's descriptor")
    if create:
        Path(out).mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, name in enumerate(names, 1):
            try:
                child = _child(fd, name, create)
            except OSError as exc:
                raise _refusal(fd, name, Path(out), names[:depth], exc) from exc
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def open_fd(out: Out, rel: str | os.PathLike[str], flags: int, *, mode: int = 0o644, create_dirs: bool = False) -> int:
    """A raw descriptor of the regular file `rel` below `out`, opened with `flags` (plus O_NOFOLLOW); UnsafePath for
    a link or anything but a regular file (a FIFO, a device) there."""
    out = _local(out, "a file descriptor")
    parent, name = split(rel)
    with directory(out, parent, create=create_dirs) as folder:
        try:
            fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=folder)
        except OSError as exc:
            raise _refusal(folder, name, Path(out), (*parts(parent), name), exc) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(f"{Path(out, rel)} is not a regular file: refused")
    return fd


def open_read(out: Out, rel: str | os.PathLike[str]) -> BinaryIO:
    """The regular file `rel` below `out`, open for reading (close it, or use it in a ``with``)."""
    if isinstance(out, StoreOut):
        split(rel)
        # a buffered binary stream, as a local file's: readers that take only io.BufferedIOBase (huggingface_hub's
        # commit of a file object) take a store's object too
        return io.BufferedReader(out.open_read(_rel(rel)))  # type: ignore[arg-type]
    return os.fdopen(open_fd(out, rel, os.O_RDONLY), "rb")


def read_bytes(out: Out, rel: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file `rel` below `out`."""
    if isinstance(out, StoreOut):
        split(rel)
        return out.read_bytes(_rel(rel))
    with open_read(out, rel) as fh:
        return fh.read()


def read_text(out: Out, rel: str | os.PathLike[str]) -> str:
    """The UTF-8 text of the regular file `rel` below `out`."""
    return read_bytes(out, rel).decode("utf-8")


def sha256(out: Out, rel: str | os.PathLike[str]) -> str:
    """sha256 of the regular file `rel` below `out`, streamed."""
    digest = hashlib.sha256()
    with open_read(out, rel) as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lstat(out: Out, rel: str | os.PathLike[str]) -> os.stat_result | None:
    """What is at `rel` below `out`, the link itself never followed; None when it (or a folder on its way) is not
    there. UnsafePath for a link, there or on the way. A store's object: its size in ``st_size``, a regular file's
    mode; a prefix with objects below it: a folder's."""
    parent, name = split(rel)
    if isinstance(out, StoreOut):
        return _store_stat(out, _rel(rel))
    try:
        with directory(out, parent) as folder:
            found = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(found.st_mode):
        raise _link(Path(out), (*parts(parent), name))
    return found


def _store_stat(out: StoreOut, rel: str) -> os.stat_result | None:
    known = out.known(rel)
    if known is not False:  # a listing snapshot answers (`snapshot`)
        if known is None:
            return None
        kind, size = known
        mode = stat.S_IFREG | 0o644 if kind == "file" else stat.S_IFDIR | 0o755
        return os.stat_result((mode, 0, 0, 1, 0, 0, size, 0, 0, 0))
    head = out.head(rel)
    if head is not None:
        return os.stat_result((stat.S_IFREG | 0o644, 0, 0, 1, 0, 0, head.size, 0, 0, 0))
    if out.listing(rel):
        return os.stat_result((stat.S_IFDIR | 0o755, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    return None


def snapshot(out: Out) -> contextlib.AbstractContextManager[None]:
    """A block in which the existence and size of files below an OUT in a store are answered from a listing of their
    folder taken once (`StoreOut.snapshot`: a LIST a thousand names, not a HEAD each); nothing for a local OUT. Only
    under OUT's writer lock."""
    return out.snapshot() if isinstance(out, StoreOut) else contextlib.nullcontext()


def size(out: Out, rel: str | os.PathLike[str]) -> int | None:
    """The size of the regular file `rel` below `out`; None when there is none (absent, or a folder)."""
    if isinstance(out, StoreOut):  # one HEAD: an object or none (or the snapshot's answer)
        split(rel)
        known = out.known(_rel(rel))
        if known is not False:
            return known[1] if known is not None and known[0] == "file" else None
        head = out.head(_rel(rel))
        return None if head is None else head.size
    found = lstat(out, rel)
    return found.st_size if found is not None and stat.S_ISREG(found.st_mode) else None


def is_file(out: Out, rel: str | os.PathLike[str]) -> bool:
    """Whether a regular file is at `rel` below `out` (UnsafePath for a link there or on the way)."""
    return size(out, rel) is not None


def is_dir(out: Out, rel: str | os.PathLike[str]) -> bool:
    """Whether a folder is at `rel` below `out` (UnsafePath for a link on the way)."""
    if not parts(rel):
        return out.exists() if isinstance(out, StoreOut) else Path(out).is_dir()
    found = lstat(out, rel)
    return found is not None and stat.S_ISDIR(found.st_mode)


def unlink(out: Out, rel: str | os.PathLike[str], *, missing_ok: bool = True) -> None:
    """Remove the file (or the link itself: unlink never follows one) at `rel` below `out`."""
    parent, name = split(rel)
    if isinstance(out, StoreOut):
        if not missing_ok and out.head(_rel(rel)) is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", shown(out, rel))
        out.delete(_rel(rel))
        return
    try:
        with directory(out, parent) as folder:
            os.unlink(name, dir_fd=folder)
    except (FileNotFoundError, NotADirectoryError):
        if not missing_ok:
            raise


def rmdir(out: Out, rel: str | os.PathLike[str]) -> bool:
    """Remove the folder `rel` below `out` when it is empty; whether it was removed (a store's folder is its objects'
    prefix: gone with the last of them)."""
    parent, name = split(rel)
    if isinstance(out, StoreOut):
        return not out.listing(_rel(rel))
    try:
        with directory(out, parent) as folder:
            os.rmdir(name, dir_fd=folder)
    except OSError:  # not empty, not there, not a folder
        return False
    return True


@dataclass(frozen=True)
class Entry:
    """One name in a folder below OUT, and what it is (a link is never followed to say)."""

    name: str
    kind: Kind


def _kind(entry: os.DirEntry[str]) -> Kind:
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    return "file" if entry.is_file(follow_symlinks=False) else "other"


def entries(out: Out, rel: str | os.PathLike[str] = "") -> list[Entry]:
    """The names in the folder `rel` below `out`, sorted; [] when it is not there."""
    if isinstance(out, StoreOut):
        return [Entry(name, kind) for name, kind in out.listing(_rel(rel))]  # type: ignore[arg-type]
    try:
        with directory(out, rel) as folder, os.scandir(folder) as listing:
            return sorted((Entry(e.name, _kind(e)) for e in listing), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def files(out: Out, rel: str | os.PathLike[str] = "") -> list[str]:
    """Every regular file below the folder `rel` of `out`, OUT-relative, sorted; UnsafePath for a link anywhere
    there (a walk never follows one, and never passes one by: a link is the finding)."""
    base = "/".join(parts(rel))
    if isinstance(out, StoreOut):
        return out.find(base)
    found: list[str] = []
    for entry in entries(out, base):
        path = f"{base}/{entry.name}" if base else entry.name
        if entry.kind == "link":
            raise _link(Path(out), parts(path))
        if entry.kind == "dir":
            found += files(out, path)
        elif entry.kind == "file":
            found.append(path)
    return sorted(found)


@dataclass(frozen=True)
class OutFile:
    """A file below OUT named by its OUT-relative path: what readers are handed instead of a path, so that they
    open it only through the door."""

    out: Out
    rel: str

    def open(self) -> BinaryIO:
        """The file, open for reading."""
        return open_read(self.out, self.rel)

    @property
    def name(self) -> str:
        return parts(self.rel)[-1]

    def __str__(self) -> str:
        return shown(self.out, self.rel)


#: One entry of `stats`: its OUT-relative path, what it is, its size (0 but for a file) and its version (a file's
#: mtime in nanoseconds; an object's ETag; "" for a folder).
Stat = tuple[str, Kind, int, str]


def stats(out: Out) -> list[Stat]:
    """Every entry below OUT, sorted by path, with its kind, size and version: a listing (one LIST a thousand objects
    in a store, one stat a file on disk), no byte read; a link is listed as one, never followed. What a token that
    approves a change of OUT is bound to (`infra.gates.conflicts.held`)."""
    if isinstance(out, StoreOut):
        return [(rel, "file", size, version) for rel, size, version in out.stats()]
    found: list[Stat] = []
    try:
        with directory(out) as top:
            _walk(top, "", found)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found)


def _walk(folder: int, prefix: str, found: list[Stat]) -> None:
    with os.scandir(folder) as listing:
        entries = [(e.name, _kind(e), e.stat(follow_symlinks=False)) for e in listing]
    for name, kind, st in entries:
        path = f"{prefix}{name}"
        if kind != "dir":
            found.append((path, kind, st.st_size if kind == "file" else 0, str(st.st_mtime_ns)))
            continue
        found.append((path, kind, 0, ""))
        child = _child(folder, name, create=False)
        try:
            _walk(child, f"{path}/", found)
        finally:
            os.close(child)
