"""A tar shard's members listed in little memory, and read back bounded (`infra.sources.bounded`).

A listing keeps, per member, only what reading it back needs (`Member`: where its bytes start, its size, its mtime,
a sparse member's map), not tarfile's `TarInfo` (~600 bytes a member with its name, its PAX dict and its numbers),
and `scan` drops each header tarfile keeps once it is read: `TarFile.next()` appends every header to
`TarFile.members`, for `getmember`, and tarfile has no option not to. A 10^6-member tar is listed in tens of MiB
of records, not a GiB of headers (`bench/tar_memory_bench.py`).
"""

from __future__ import annotations

import sys
import tarfile
from collections.abc import Iterator, Sequence
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
    the size it expands to), its mtime, whether it is a regular file, and a sparse member's map (data runs)."""

    offset_data: int
    size: int
    mtime: float
    regular: bool = True
    sparse: tuple[tuple[int, int], ...] | None = None


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
        yield info.name, Member(info.offset_data, info.size, info.mtime, info.isfile(), sparse)


#: A `Member` as a JSON value (`record` / `from_record`): what a plan records of a listing (`infra.cache.listing.
#: spool_records`) for a shard task to read the member again without listing the tar (`Source.relisted`).
MemberRecord = list[Any]


def record(member: Member | None) -> MemberRecord | None:
    """`member` as a JSON value (None stays None)."""
    if member is None:
        return None
    sparse = [list(run) for run in member.sparse] if member.sparse is not None else None
    return [member.offset_data, member.size, member.mtime, member.regular, sparse]


def from_record(value: MemberRecord | None) -> Member | None:
    """The `Member` `record` made `value` from (None stays None)."""
    if value is None:
        return None
    offset, size, mtime, regular, sparse = value
    runs = tuple((int(a), int(b)) for a, b in sparse) if sparse is not None else None
    return Member(int(offset), int(size), mtime, bool(regular), runs)


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


def span(members: Sequence[Member | None]) -> tuple[int, int] | None:
    """(start, end) in a plain tar of the bytes of `members`, where each is listed, regular and not sparse, and they
    lie together (no more than `SPAN_SLACK` bytes between them in all); None otherwise."""
    listed = [m for m in members if m is not None and m.regular and m.sparse is None]
    if not listed or len(listed) != len(members):
        return None
    start, end = min(m.offset_data for m in listed), max(m.offset_data + m.size for m in listed)
    return (start, end) if end - start <= sum(m.size for m in listed) + SPAN_SLACK else None


def read_span(
    stream: IO[bytes], named: Sequence[tuple[str, Member]], where: tuple[int, int], max_mb: int
) -> list[bytes]:
    """The bytes of each member of `named` in one read of the plain tar `stream` (one range request of a store's) at
    `where` (`span`), each member's size checked against `max_mb` MiB before any byte is read (`check_size`). A
    member past the end of what came back is short: its reader says so."""
    for name, member in named:
        check_size(name, member.size, max_mb)
    start, end = where
    stream.seek(start)
    data = stream.read(end - start)
    return [data[m.offset_data - start : m.offset_data - start + m.size] for _, m in named]
