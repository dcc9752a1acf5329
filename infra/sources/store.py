"""A source's files in an object store: ``s3://``, ``hf://datasets/ORG/NAME[@rev][/path]``, ``gs://`` or any other
fsspec URL, read through fsspec and the store's own library (s3fs, `huggingface_hub.HfFileSystem`, gcsfs).

What a local file gives by `os.stat` (size, mtime), an object gives by what its store lists: its size and its
version (an S3 version id or ETag, a Hub blob id, a GCS generation), so a changed object is told from the one listed.
A read is bounded like a local one (`infra.sources.bounded`): the size the store lists is checked before a byte
arrives, and no more than that is asked for. Tars are opened as seekable streams of range requests
(`open_stream`): listing one reads its headers and a small read-ahead after each, not its members.

Credentials come from each store's own chain (the AWS chain for s3fs, ``HF_TOKEN`` or the Hub login for
``hf://``, gcloud's for gcsfs) and never pass through latentforge's settings: a URL names a place, not a key.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO, Any

from infra.errors import InputError, SourceError
from infra.fetch import version_of
from infra.sources import retries
from infra.sources.bounded import check_size
from infra.urls import redacted, store_settings_problem, url_problem

logger = logging.getLogger(__name__)

#: The extra that brings each store's library (a missing one is named in the error).
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "hf": "hub"}
#: A tar's read-ahead: what a range request asks for past what is read (a tar header is 512 bytes; a caption
#: member and the header after it usually arrive in the same request).
TAR_BLOCK = 16 * 1024
#: The stores whose URLs begin with a bucket: where a listing finds nothing, whether the bucket is there is asked.
BUCKETED = ("s3", "s3a", "gs", "gcs")


class NoSuchBucket(OSError):
    """The bucket a URL names does not exist (a listing of it would read as empty)."""


@dataclass(frozen=True, slots=True)
class Stat:
    """An object as its store lists it: its size and its version ("" where the store gives none)."""

    size: int
    version: str


def filesystem(url: str) -> tuple[Any, str]:
    """(the fsspec file system, the path in it) for `url`; SourceError naming the extra when its library is missing."""
    import fsspec  # noqa: PLC0415 - only a source in a store needs it

    scheme = url.split("://", 1)[0].lower()
    if (problem := url_problem(url)) is not None:  # the spec is recorded in OUT (cache.json, the run report)
        raise SourceError(f"{shown(url)}: {problem}")
    if (problem := store_settings_problem([url], dict(os.environ))) is not None:
        raise SourceError(f"{shown(url)}: {problem}")
    options: dict[str, Any] = {}
    if scheme == "hf" and os.environ.get("HF_ENDPOINT"):  # huggingface_hub reads it once, at import
        options["endpoint"] = os.environ["HF_ENDPOINT"]
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
        if scheme in ("s3", "s3a"):
            retries.watch_s3(fs)  # its client's retries counted (`infra.sources.retries`)
        elif scheme == "hf":
            retries.watch_hub()  # huggingface_hub's shared client: its retries counted
        return fs, path
    except ImportError as exc:
        extra = EXTRAS.get(scheme)
        hint = f": pip install 'latentforge[{extra}]'" if extra else ""
        raise SourceError(f"{scheme}:// sources need a library that is not installed ({exc}){hint}") from exc
    except ValueError as exc:  # an unknown protocol, a Hub URL that names no repo
        raise SourceError(f"{shown(url)}: not a store URL fsspec can open ({exc})") from exc


def shown(url: str) -> str:
    """`url` as it may be printed: its credentials hidden, whatever their shape (`infra.urls.redacted`)."""
    return redacted(url)


def stat_of(info: dict[str, Any]) -> Stat:
    return Stat(size=int(info.get("size") or 0), version=version_of(info))


def stat(url: str) -> Stat:
    """The object at `url` as its store lists it now; FileNotFoundError when it is not there."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)  # fsspec keeps listings: the object as it is now, not as it was listed
    return stat_of(fs.info(path))


def find(spec: str) -> dict[str, Stat]:
    """Every file `spec` names (a pattern, a folder searched recursively, or one object), by URL, sorted; {} when it
    names nothing; NoSuchBucket when its bucket is not there."""
    fs, path = filesystem(spec)
    fs.invalidate_cache()  # fsspec keeps listings a process long: the store as it is now (a rewritten object)
    if any(ch in path for ch in "*?["):
        found = fs.glob(path, detail=True)
    else:  # a folder's objects in one listing (no listing of its first level before: 2× the LISTs of a big prefix)
        try:
            found = fs.find(path, detail=True)
        except FileNotFoundError:  # a bucket that is not there (s3fs): said by `check_bucket` below
            found = {}
        if not found and fs.exists(path):
            found = {path: fs.info(path)}
    if not found:
        check_bucket(fs, spec)
    files = {fs.unstrip_protocol(p): stat_of(info) for p, info in found.items() if info.get("type") != "directory"}
    return dict(sorted(files.items()))


def check_bucket(fs: Any, url: str) -> None:
    """NoSuchBucket when `url` names a bucket (`BUCKETED`) that its store says does not exist."""
    scheme, _, rest = url.partition("://")
    bucket = rest.split("/", 1)[0]
    if scheme.lower() in BUCKETED and bucket and not fs.exists(bucket):
        raise NoSuchBucket(f"the bucket {bucket!r} does not exist")


def join(base: str, rel: str) -> str:
    """`rel` (a posix path, no ``..``) below the folder URL `base`."""
    return f"{base.rstrip('/')}/{rel.lstrip('/')}"


def parent(url: str) -> str:
    """The folder URL an object's URL is in."""
    return url.rstrip("/").rpartition("/")[0]


def name(url: str) -> str:
    return PurePosixPath(url.rstrip("/")).name


def changed(url: str, listed: Stat) -> str | None:
    """What differs between the object at `url` now and as `listed`; None when nothing; FileNotFoundError when gone."""
    return differences(listed, stat(url))


def differences(listed: Stat, now: Stat) -> str | None:
    """What differs between an object as `listed` and as it is `now` (a version is compared where one was listed)."""
    changes = []
    if now.size != listed.size:
        changes.append(f"size {listed.size} → {now.size}")
    if listed.version and now.version != listed.version:
        changes.append(f"version {listed.version} → {now.version}")
    return ", ".join(changes) or None


def read(url: str, listed: Stat | None, max_mb: int, *, reason: str = "member_unreadable") -> bytes:
    """The object's bytes, checked against its listing (InputError ``source_changed`` / ``source_vanished``) and its
    size against `max_mb` MiB (``too_large``) before any byte is fetched; no more than that size asked for. A store's
    transient errors are retried by its own library, a short answer here (`infra.sources.retries`); one that remains
    is InputError `reason`."""
    try:
        now = stat(url)
        if listed is not None and differences(listed, now):
            raise InputError("source_changed", f"{shown(url)} changed since it was listed: not read")
        check_size(shown(url), now.size, max_mb)
        fs, path = filesystem(url)

        def fetch(start: int, n: int) -> bytes:
            return fs.cat_file(path, start=start, end=start + n)

        data = retries.read_rest(fetch, 0, now.size, shown(url)) if now.size else b""
    except FileNotFoundError:
        raise InputError("source_vanished", f"{shown(url)} vanished since it was listed") from None
    except OSError as exc:
        raise InputError(reason, f"{shown(url)}: {exc}") from exc
    if len(data) != now.size:
        raise InputError(reason, f"{shown(url)}: {len(data)} of {now.size} bytes")
    return data


def expired(exc: BaseException) -> bool:
    """Whether a read failed because the object is no longer the one opened (s3fs's `FileExpired`: a 412 on a pinned
    range request, `WholeReads.pinned`)."""
    return type(exc).__name__ == "FileExpired" and isinstance(exc, OSError)


def read_whole(url: str) -> bytes:
    """A small object's bytes (a metadata file): FileNotFoundError when it is not there."""
    fs, path = filesystem(url)
    return fs.cat_file(path)


def open_stream(url: str) -> IO[bytes]:
    """The object as a seekable file of range requests, each asking `TAR_BLOCK` past what is read; a read answers
    every byte asked up to the object's end (a short range answer is asked again for the rest, and counted)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)  # opened as it is now, its reads pinned to that (not to a listing kept since)
    return WholeReads(fs.open(path, "rb", block_size=TAR_BLOCK, cache_type="readahead"), shown(url))  # type: ignore[return-value]


class WholeReads:
    """A store's file whose `read(n)` returns n bytes (fewer only at the end), whatever each range answer held: a
    reader of a tar takes a short read for the end of the data."""

    mode = "rb"

    def __init__(self, file: Any, where: str) -> None:
        self._file, self.name = file, where

    def read(self, size: int | None = -1) -> bytes:
        pos = self._file.tell()
        left = max(self._file.size - pos, 0)
        want = left if size is None or size < 0 else min(size, left)
        if want == 0:
            return b""
        data = retries.read_rest(self._read_at, pos, want, self.name)
        self._file.seek(pos + len(data))
        return data

    def pinned(self) -> Stat | None:
        """The object as it was opened, when every range request asks for that one only (S3's ``If-Match`` on the
        ETag s3fs read at opening: a changed object's answer is a 412, `FileExpired`); None when reads are not
        pinned (another store)."""
        if "IfMatch" not in (getattr(self._file, "read_kw", None) or {}):
            return None
        return stat_of(self._file.details)

    def _read_at(self, start: int, n: int) -> bytes:
        self._file.seek(start)
        return self._file.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()
