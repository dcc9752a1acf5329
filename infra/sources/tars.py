"""A tar shard's members listed in little memory, and read back bounded (`infra.sources.bounded`).

A listing keeps, per member, only what reading it back needs (`Member`: where its bytes start, its size, its mtime,
a sparse member's map), not tarfile's `TarInfo` (~600 bytes a member with its name, its PAX dict and its numbers),
and `scan` drops each header tarfile keeps once it is read: `TarFile.next()` appends every header to
`TarFile.members`, for `getmember`, and tarfile has no option not to. A 10^6-member tar is listed in tens of MiB
of records, not a GiB of headers (`bench/tar_memory_bench.py`).
"""

from __future__ import annotations

import io
import math
import sys
import tarfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from infra.sources.bounded import check_size

#: A tar read in place: a member's offset is where its bytes are in the file (a compressed tar's are not).
PLAIN_TAR = ".tar"


class TarDamaged(Exception):
    """The tar cannot be listed past this point (`scan` raises it after yielding the members before it)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One member as listed: where its bytes start in the (uncompressed) tar stream, its size (a sparse member's:
    the size it expands to), its mtime, whether it is a regular file, a sparse member's map (data runs), and where
    its header begins (its extended headers' first block: what `prove` reads; -1: not known)."""

    offset_data: int
    size: int
    mtime: float
    regular: bool = True
    sparse: tuple[tuple[int, int], ...] | None = None
    offset: int = -1


#: The store stream each tar opened from a URL reads (`opened_from`): a member's offset is its place in it.
_streams: weakref.WeakKeyDictionary[tarfile.TarFile, Any] = weakref.WeakKeyDictionary()


def opened_from(tf: tarfile.TarFile, stream: Any) -> None:
    """Note that `tf` reads the store's `stream` (`stream_of`)."""
    _streams[tf] = stream


def stream_of(tf: tarfile.TarFile) -> Any:
    """The store stream `tf` was opened from (`opened_from`); None for a tar read from a local file."""
    return _streams.get(tf)


def scan(tf: tarfile.TarFile) -> Iterator[tuple[str, Member]]:
    """(name, `Member`) of every member of a tar opened for reading, in order, without reading any member's bytes
    and without keeping tarfile's headers; TarDamaged (``tar damaged: ...``) after the members before the damage."""
    while True:
        try:
            info = tf.next()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise TarDamaged(f"tar damaged: {exc}") from exc
        if info is None:
            return
        tf.members.clear()  # tarfile keeps every header it reads (see the module's docstring): ours are records
        sparse = tuple(map(tuple, info.sparse)) if info.sparse is not None else None
        yield info.name, Member(info.offset_data, info.size, info.mtime, info.isfile(), sparse, info.offset)


#: A `Member` as a JSON value (`record` / `from_record`): what a plan records of a listing (`infra.cache.listing.
#: spool_records`) for a shard task to read the member again without listing the tar (`Source.relisted`).
MemberRecord = list[Any]


def record(member: Member | None) -> MemberRecord | None:
    """`member` as a JSON value (None stays None)."""
    if member is None:
        return None
    sparse = [list(run) for run in member.sparse] if member.sparse is not None else None
    return [member.offset_data, member.size, member.mtime, member.regular, sparse, member.offset]


class BadRecord(ValueError):
    """A record of a listing that is not one `record` makes, or that points outside its tar: the listing is not
    used (the tar is listed again)."""


#: The most header bytes a member may have before its data (its PAX or GNU long-name headers included): a record
#: that says more is not a listing's.
MAX_HEADERS = 1 << 20


def from_record(value: MemberRecord | None, tar_size: int = 0) -> Member | None:
    """The `Member` `record` made `value` from (None stays None), checked for shape and range: BadRecord for a value
    `record` would not make, or (given the tar's size) a member whose header or bytes lie past its end."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 6:
        raise BadRecord(f"a member record is a list of 6 values, not {_shown(value)}")
    offset_data, size, mtime, regular, sparse, offset = value
    if not all(_count(n) for n in (offset_data, size, offset)) or not isinstance(regular, bool):
        raise BadRecord(f"a member record's offsets and size are counts, its kind a bool: {_shown(value)}")
    if isinstance(mtime, bool) or not isinstance(mtime, int | float) or not math.isfinite(mtime):
        raise BadRecord(f"a member record's mtime is a finite number: {_shown(value)}")
    headers = offset_data - offset
    if headers <= 0 or headers % tarfile.BLOCKSIZE or headers > MAX_HEADERS or offset % tarfile.BLOCKSIZE:
        raise BadRecord(f"a member's data starts one or more header blocks after its header: {_shown(value)}")
    runs = _runs(sparse, value)
    if tar_size and (offset_data > tar_size or (runs is None and offset_data + size > tar_size)):
        raise BadRecord(f"a member record points past the end of its tar ({tar_size} bytes): {_shown(value)}")
    return Member(offset_data, size, mtime, regular, runs, offset)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _runs(sparse: Any, value: Any) -> tuple[tuple[int, int], ...] | None:
    if sparse is None:
        return None
    if not isinstance(sparse, list) or not all(
        isinstance(run, list) and len(run) == 2 and all(map(_count, run)) for run in sparse
    ):
        raise BadRecord(f"a sparse member's map is a list of [offset, size] counts: {_shown(value)}")
    return tuple((a, b) for a, b in sparse)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def header_bytes(stream: IO[bytes], member: Member) -> bytes:
    """The bytes of `member`'s headers in the plain tar `stream` (from `Member.offset` to its data): one small read
    (a range request of a store's)."""
    stream.seek(member.offset)
    return stream.read(member.offset_data - member.offset)


def prove(headers: bytes, member: Member, named: Callable[[str], bool]) -> str | None:
    """None when `headers` (the tar's bytes from `member.offset` to its data: `header_bytes`) are a member header
    that `named` accepts the name of, with the member's size, kind, sparse map and data offset; else what differs,
    in a few words. A record proven so reads the bytes its listing found, not another member's."""
    if len(headers) != member.offset_data - member.offset:
        return f"{len(headers)} header bytes where the record says {member.offset_data - member.offset}"
    try:  # tarfile parses the headers (a PAX or GNU long name's too); the member's data is not in `headers`
        with tarfile.open(fileobj=io.BytesIO(headers + bytes(2 * tarfile.BLOCKSIZE)), mode="r:") as tf:
            info = tf.next()
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        return f"no member header there ({exc})"
    if info is None:
        return "no member header there"
    sparse = tuple(map(tuple, info.sparse)) if info.sparse is not None else None
    found = (info.size, info.isfile(), sparse, member.offset + info.offset_data)
    if not named(info.name):
        return f"the header there names {info.name!r}"
    if found != (member.size, member.regular, member.sparse, member.offset_data):
        return f"the header there says size {info.size} at {member.offset + info.offset_data}"
    return None


def short(text: str) -> str:
    """`text` interned: the few member suffixes a tar repeats (``prompt.txt``, ``jpg``) held once, not per member."""
    return sys.intern(text)


def read_member(tf: tarfile.TarFile, name: str, member: Member, max_mb: int) -> bytes:
    """The bytes of the regular member `member` (listed by `scan` from `tf`), its size checked against `max_mb`
    MiB before any byte is read (`check_size`: InputError ``too_large``; a sparse member at the size it expands
    to), and no more than that size read. tarfile's errors as it raises them."""
    check_size(name, member.size, max_mb, sparse=member.sparse is not None)
    info = tarfile.TarInfo(name)  # what `TarFile.extractfile` reads a regular member by (its documented slots)
    info.size, info.offset_data = member.size, member.offset_data
    info.sparse = list(member.sparse) if member.sparse is not None else None
    handle = tf.extractfile(info)
    if handle is None:  # a regular TarInfo always has a reader; kept for tarfile's documented None
        raise tarfile.ReadError(f"{name}: no reader for the member")
    return handle.read(member.size)


#: The most a read of a sample's members together fetches beyond their own bytes (the headers between them): more,
#: and each is read on its own.
SPAN_SLACK = 64 * 1024


def span(members: Sequence[Member | None], headers: bool = False) -> tuple[int, int] | None:
    """(start, end) in a plain tar of the bytes of `members` (with `headers`: from the first one's header on, so
    that their records can be proven from the same read), where each is listed, regular and not sparse, and they
    lie together (no more than `SPAN_SLACK` bytes between them in all); None otherwise."""
    listed = [m for m in members if m is not None and m.regular and m.sparse is None and (m.offset >= 0 or not headers)]
    if not listed or len(listed) != len(members):
        return None
    start = min(m.offset if headers else m.offset_data for m in listed)
    end = max(m.offset_data + m.size for m in listed)
    return (start, end) if end - start <= sum(m.size for m in listed) + SPAN_SLACK else None


def read_span(stream: IO[bytes], named: Sequence[tuple[str, Member]], where: tuple[int, int], max_mb: int) -> bytes:
    """The bytes of the plain tar `stream` at `where` (`span`) in one read (one range request of a store's), each
    member of `named` checked against `max_mb` MiB before any byte is read (`check_size`); `cut` takes a member's
    bytes (or its headers') out of them. A read past the end of the tar comes back short: the member's reader says
    so."""
    for name, member in named:
        check_size(name, member.size, max_mb)
    start, end = where
    stream.seek(start)
    return stream.read(end - start)


def cut(block: bytes, where: tuple[int, int], first: int, stop: int) -> bytes:
    """The bytes [first, stop) of the tar, out of `block`, the bytes read at `where` (`read_span`)."""
    return block[first - where[0] : stop - where[0]]
