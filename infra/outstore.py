"""OUT in an object store (``--out s3://BUCKET/PREFIX``): the second backend of the door to OUT (`infra.outdir`).

A `StoreOut` names the store's folder by URL (never a key: a URL with ``user:password@`` is refused, credentials
come from the store's own chain). Every operation takes an OUT-relative path the door has checked already (no
``..``, no absolute path) and reaches one object below the URL's prefix; a store has no links to follow.

Writes are whole objects, one PUT each (spooled by `infra.storage`, a large one in a local temp file): a no-clobber
write is a conditional put (``If-None-Match: *``, S3's; a 412 is the FileExistsError of a local no-clobber link),
``replace`` a plain put.
The writer lock is a lease object written with conditional puts too (``If-None-Match: *`` to take it, ``If-Match``
on its ETag to renew or take over an expired one: `infra.cache.lock`).

Stores: ``s3://`` (and ``s3a://``) through s3fs; ``memory://`` (fsspec's in-process store, for tests) keeps the
promises by check-then-put inside this one process. Any other scheme is refused: its conditional put is not tested
here (the Hub takes a cache by ``--upload``, its commit model has no per-object put).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

from infra.errors import ConfigError, LeaseLost, OutNotWritable
from infra.urls import redacted, store_settings_problem, url_problem

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: The schemes OUT may name: those whose conditional put is used and tested.
SCHEMES = ("s3", "s3a", "memory")
#: Called with the S3 file system of each OUT operation: `infra.sources.retries` (a floor above) adds the one that
#: counts its client's retries (`watch_s3`), so that OUT's are in the run report's ``store_retries`` as a source's.
S3_WATCHERS: list[Callable[[Any], None]] = []
#: S3's answers that mean "this store refuses writes here" (no later write would get past them).
REFUSALS = ("AccessDenied", "AllAccessDisabled", "NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch")
#: The OUTs (URL → why) whose lease this process lost (`infra.cache.lock`): every later write below one is refused
#: before it is sent (LeaseLost), so a run that knows another owns OUT puts nothing more there.
_lost: dict[str, str] = {}
#: The OUTs (URL → check) whose lease another process holds for the run this process writes for (a Ray worker's shard
#: task: `infra.cache.lock.follow`): before each write below one, `check` reads the lease and answers None while it is
#: the run's, else why not; then the write, and every later one, is refused (LeaseLost) as where the lease was lost.
_guards: dict[str, Callable[[], str | None]] = {}


def guard(url: str, check: Callable[[], str | None]) -> None:
    """Ask `check` before each write of this process below the OUT `url` (None: the run's lease holds; else why not)."""
    _guards[url.rstrip("/")] = check


def unguard(url: str) -> None:
    """No more checks before the writes below `url`; they are this process's own again (`regain`)."""
    _guards.pop(url.rstrip("/"), None)
    regain(url)


def lose(url: str, why: str) -> None:
    """Refuse every later write of this process below the OUT `url` (its lease was lost): `why` is the error's text."""
    _lost[url.rstrip("/")] = why


def regain(url: str) -> None:
    """Writes below `url` are this process's own again (its lease context ended)."""
    _lost.pop(url.rstrip("/"), None)


def is_url(spec: str) -> bool:
    """True when `spec` (a model, a source's path, OUT) is a URL (``scheme://...``) rather than a local path."""
    return bool(_URL.match(spec))


@dataclass(frozen=True)
class Head:
    """An object as its store answers for it: its size and its ETag ("" where the store gives none)."""

    size: int
    etag: str


@dataclass(frozen=True)
class StoreOut:
    """OUT as a folder URL in an object store (no trailing ``/``). Picklable: a worker opens the store itself."""

    url: str

    @classmethod
    def of(cls, url: str) -> StoreOut:
        """The StoreOut of `url`; ConfigError for credentials in it (any shape: `infra.urls`), a bucket S3 refuses or
        a scheme OUT cannot be."""
        if (problem := url_problem(url)) is not None:
            raise ConfigError(f"--out: {problem}")
        scheme = url.split("://", 1)[0].lower()
        if scheme not in SCHEMES:
            raise ConfigError(
                f"--out {redacted(url)}: OUT may be a local folder or {', '.join(f'{s}://' for s in SCHEMES)} (a store "
                "with a conditional put); publish to the Hub with --upload"
            )
        return cls(url.rstrip("/"))

    def __str__(self) -> str:
        return self.url

    def __truediv__(self, rel: str) -> StoreOut:
        """The URL of `rel` below this one (for messages; reads and writes go through `infra.outdir`)."""
        return StoreOut(f"{self.url}/{str(rel).strip('/')}")

    def as_posix(self) -> str:
        return self.url

    def relative_to(self, base: StoreOut) -> PurePosixPath:
        """The path of this URL below `base` (ValueError when it is not below it), as `Path.relative_to` answers."""
        if not self.url.startswith(base.url + "/"):
            raise ValueError(f"{self.url} is not below {base.url}")
        return PurePosixPath(self.url[len(base.url) + 1 :])

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StoreOut:
        """The URL one folder up (as `Path.parent`: a report's path names its OUT)."""
        return StoreOut(self.url.rsplit("/", 1)[0])

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    def fs(self) -> tuple[Any, str]:
        """(the fsspec file system, OUT's path in it). Asked each time: fsspec keeps one client per store."""
        import fsspec  # noqa: PLC0415 - optional: a store's library (the `s3` extra)

        if (problem := store_settings_problem([self.url], dict(os.environ))) is not None:
            raise ConfigError(f"--out {self.url}: {problem}")
        try:
            fs, path = fsspec.core.url_to_fs(self.url)
        except ImportError as exc:
            hint = "pip install 'latentforge[s3]'"
            raise ConfigError(f"--out {self.url}: its store's library is missing ({exc}): {hint}") from exc
        if self.scheme in ("s3", "s3a"):
            for watch in S3_WATCHERS:  # its client's retries counted in the run report, as a source's are
                watch(fs)
        return fs, path

    def at(self, rel: str) -> tuple[Any, str]:
        """(the file system, the store path of the OUT-relative `rel`; "" is OUT itself), in one lookup."""
        fs, base = self.fs()
        base = base.rstrip("/")
        return fs, f"{base}/{rel}" if rel else base

    # -- reads -------------------------------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes:
        fs, path = self.at(rel)
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{rel}") from None

    def open_read(self, rel: str) -> IO[bytes]:
        fs, path = self.at(rel)
        fs.invalidate_cache(path)
        try:
            return fs.open(path, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{rel}") from None

    def known(self, rel: str) -> tuple[str, int] | bool | None:
        """What a listing snapshot (`snapshot`) says is at `rel`: ("file", size), ("dir", 0) or None (nothing);
        False when no snapshot is taken of this OUT now (ask the store)."""
        snap = _snapshots.get(self.url)
        if snap is None or self.scheme not in ("s3", "s3a"):
            return False
        return snap.answer(self, rel)

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """While the block runs, the existence and size of an object below OUT (`infra.outdir.lstat`, `size`) are
        answered from a listing of its folder taken once, a page (1000 names) at a time from the name asked on,
        kept true by this process's own puts and deletes (`put`, `delete`), instead of a HEAD (and a LIST when
        absent) each. For a block that holds OUT's writer lock (no other writer changes OUT meanwhile), or one that
        only reads (verify: its answer is of the moment it looked, a listing's as a HEAD's). Blocks of this process
        (a shard task's threads) share one snapshot of an OUT, dropped when the last one ends."""
        with _snapshots_lock:
            snap = _snapshots.setdefault(self.url, _Snapshot())
            snap.users += 1
        try:
            yield
        finally:
            with _snapshots_lock:
                snap.users -= 1
                if snap.users == 0 and _snapshots.get(self.url) is snap:
                    del _snapshots[self.url]

    def _list_page(self, folder: str, start_after: str) -> tuple[dict[str, tuple[str, int]], str | None]:
        """One page of the folder `folder`'s names after `start_after` (a name, "" for the first), each as
        (kind, size), a folder's with a trailing ``/``; and the last name it holds (None: the folder's end)."""
        fs, path = self.at(folder)
        bucket, key = _bucket_key(path)
        prefix = f"{key}/" if key else ""
        ask: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/", "MaxKeys": PAGE}
        if start_after:  # after a folder (``sub/``): after every name below it too
            ask["StartAfter"] = prefix + (f"{start_after[:-1]}0" if start_after.endswith("/") else start_after)
        try:
            answer = fs.call_s3("list_objects_v2", **ask)
        except FileNotFoundError:
            return {}, None
        except OSError as exc:
            raise self._refused(folder or ".", exc) from exc
        found = {item["Key"][len(prefix) :]: ("file", int(item.get("Size", 0))) for item in answer.get("Contents", [])}
        found.update({item["Prefix"][len(prefix) :]: ("dir", 0) for item in answer.get("CommonPrefixes", [])})
        found.pop("", None)  # a folder marker object (the prefix itself)
        last = max(found, default=start_after)
        return found, last if answer.get("IsTruncated") else None

    def head(self, rel: str) -> Head | None:
        """The object at `rel` as its store answers now; None when there is none (a prefix is not an object)."""
        fs, path = self.at(rel)
        if self.scheme in ("s3", "s3a"):
            bucket, key = _bucket_key(path)
            try:
                answer = fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._refused(rel, exc) from exc
            return Head(int(answer.get("ContentLength", 0)), str(answer.get("ETag", "")).strip('"'))
        fs.invalidate_cache(path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return Head(int(info.get("size") or 0), _memory_etag(fs, path))

    def listing(self, rel: str) -> list[tuple[str, str]]:
        """(name, "file" | "dir") of what is directly below the folder `rel`, sorted; [] when there is nothing."""
        fs, path = self.at(rel)
        try:
            found = fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for info in found:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info["name"].rstrip("/") == path.rstrip("/"):  # an object named like the folder: not below it
                continue
            out.append((name, "dir" if info.get("type") == "directory" else "file"))
        return sorted(set(out))

    def find(self, rel: str) -> list[str]:
        """Every object below the folder `rel`, OUT-relative, sorted."""
        fs, base = self.at("")
        path = f"{base}/{rel}" if rel else base
        fs.invalidate_cache(path)
        try:
            found = fs.find(path, withdirs=False)
        except FileNotFoundError:
            return []
        return sorted(p[len(base) + 1 :] for p in found if p.startswith(base + "/") and p != path)

    def stats(self) -> list[tuple[str, int, str]]:
        """(OUT-relative name, size, version) of every object below OUT, sorted: one listing, no byte read; the
        version is the store's ETag (else its modification time: a store that gives none)."""
        fs, base = self.at("")
        fs.invalidate_cache(base)
        try:
            found = fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return []
        listed = []
        for path, info in found.items():
            if not path.startswith(base + "/"):
                continue
            version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
            listed.append((path[len(base) + 1 :], int(info.get("size") or 0), str(version).strip('"')))
        return sorted(listed)

    def exists(self) -> bool:
        """Whether anything is below OUT's prefix."""
        return bool(self.listing(""))

    # -- writes ------------------------------------------------------------------------------------------------

    def put(
        self,
        rel: str,
        data: bytes | IO[bytes],
        *,
        create: bool = False,
        match: str | None = None,
        same_ok: bool = False,
    ) -> str:
        """Write the object `rel` (bytes, or a local file sent from its start) in one request; its new ETag.
        `create`: only where there is none (FileExistsError otherwise; with `same_ok`, not where the object there is
        these very bytes: `_holds`); `match`: only over the object whose ETag that is (FileExistsError otherwise);
        neither: over whatever is there. OutNotWritable when the store refuses writes; LeaseLost when this run lost
        OUT's lease."""
        self._held(rel)
        fs, path = self.at(rel)
        if self.scheme in ("s3", "s3a"):
            bucket, key = _bucket_key(path)
            cond = {"IfNoneMatch": "*"} if create else {"IfMatch": f'"{match}"'} if match else {}
            try:
                answer = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
            except OSError as exc:
                if not _precondition(exc):
                    raise self._refused(rel, exc) from exc
                if not (create and same_ok and self._holds(rel, data)):
                    raise FileExistsError(errno.EEXIST, "exists: not overwriting it", f"{self.url}/{rel}") from None
                answer = {"ETag": _md5(data)}  # our own put, whose answer was lost: retried, it met itself
            fs.invalidate_cache(path)
            _noted(self, rel, _size(data))
            return str(answer.get("ETag", "")).strip('"')
        # memory://: check-then-put, whole inside this process (the store is this process's own)
        data = data if isinstance(data, bytes) else data.read()
        found = self.head(rel)
        if (create and found is not None) or (match is not None and (found is None or found.etag != match)):
            raise FileExistsError(errno.EEXIST, "exists: not overwriting it", f"{self.url}/{rel}")
        fs.pipe_file(path, data)
        return _memory_etag(fs, path)

    def _holds(self, rel: str, data: bytes | IO[bytes]) -> bool:
        """Whether the object at `rel` is `data` (its ETag the MD5 of a single-part put of them): a conditional put
        whose first attempt was written but whose answer was lost (a reset connection) is retried by the client and
        meets its own object (a 412: s3fs, botocore and aiohttp each retry a reset, and only botocore says so); that
        put is done, not refused. Asked only after a 412, and only for a whole file (`infra.storage.atomic_file`):
        a lease or a journal part is never taken for another's that holds the same bytes."""
        head = self.head(rel)
        return head is not None and head.size == _size(data) and head.etag == _md5(data)

    def delete(self, rel: str) -> None:
        """Remove the object `rel` (nothing there is no error)."""
        self._held(rel)
        fs, path = self.at(rel)
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._refused(rel, exc) from exc
        fs.invalidate_cache(path)
        _noted(self, rel, None)

    def delete_many(self, rels: list[str]) -> None:
        """Remove the objects `rels` (S3: up to 1000 in a request)."""
        if not rels:
            return
        self._held(rels[0])
        fs, base = self.at("")
        paths = [f"{base}/{rel}" for rel in rels]
        try:
            fs.rm(paths)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._refused(rels[0], exc) from exc
        for path, rel in zip(paths, rels, strict=True):
            fs.invalidate_cache(path)
            _noted(self, rel, None)

    def _held(self, rel: str) -> None:
        """LeaseLost when this process lost the lease of the OUT `rel` is below, or (a worker of the run that holds it:
        `guard`) the lease is no longer the run's: nothing more is sent there."""
        for url, why in list(_lost.items()):
            if self.url == url or self.url.startswith(url + "/"):
                raise LeaseLost(why, f"{self.url}/{rel}")
        for url, check in list(_guards.items()):
            if self.url == url or self.url.startswith(url + "/"):
                why = check()
                if why is not None:
                    lose(url, why)
                    raise LeaseLost(why, f"{self.url}/{rel}")

    def _refused(self, rel: str, exc: OSError) -> OSError:
        """The error of a request the store refused: OutNotWritable where no later write would get past it (no
        permission, no bucket), else `exc` as it is."""
        code = _code(exc)
        if isinstance(exc, PermissionError) or code in REFUSALS or _no_bucket(exc):
            why = code or type(exc).__name__
            return OutNotWritable(f"{self.url}/{rel}: the store refuses it ({why}: {_message(exc)})", self.url)
        return exc


#: Names a snapshot's LIST asks for at once (S3's most).
PAGE = 1000


@dataclass
class _Window:
    """A folder's names listed after `after` up to `last` (None: to the folder's end), each as (kind, size)."""

    after: str
    last: str | None
    names: dict[str, tuple[str, int]] = field(default_factory=dict)

    def covers(self, name: str) -> bool:
        """Whether the listing answers for `name` (an object, or a folder: ``name/``)."""
        return self.after < name and (self.last is None or f"{name}/" <= self.last)


class _Snapshot:
    """OUT's folders as listed by a `StoreOut.snapshot`: one window of names a folder, moved forward (or started
    again at the name asked) when a name past it is asked; this process's puts and deletes written into it."""

    def __init__(self) -> None:
        self.users = 0
        self.lock = threading.Lock()
        self.windows: dict[str, _Window] = {}

    def answer(self, out: StoreOut, rel: str) -> tuple[str, int] | None:
        folder, _, name = rel.rpartition("/")
        with self.lock:  # held while listing: a put noted meanwhile waits, then lands in the new window
            window = self.windows.get(folder)
            if window is None or not window.covers(name):
                window = self._listed(out, folder, name, window)
            return window.names.get(name) or window.names.get(f"{name}/")

    def _listed(self, out: StoreOut, folder: str, name: str, window: _Window | None) -> _Window:
        """The window that covers `name`: the folder's listing continued from where it ends where `name` is near
        after it, else listed anew from just before `name` (its name less its last character)."""
        start = name[:-1]
        if window is None or window.last is None or not (window.after < name and start <= window.last):
            window = self.windows[folder] = _Window(start, start)
        while not window.covers(name):
            found, last = out._list_page(folder, window.last or "")
            window.names.update(found)
            window.last = last
        return window

    def note(self, rel: str, size: int | None) -> None:
        folder, _, name = rel.rpartition("/")
        with self.lock:
            window = self.windows.get(folder)
            if window is None or not window.covers(name):
                return  # a later listing of it sees the store as it is after this
            if size is None:
                window.names.pop(name, None)
            else:
                window.names[name] = ("file", size)


_snapshots: dict[str, _Snapshot] = {}
_snapshots_lock = threading.Lock()


def _noted(out: StoreOut, rel: str, size: int | None) -> None:
    """A put (`size`) or delete (None) of `rel` made by this process, written into OUT's snapshot if one is taken."""
    snap = _snapshots.get(out.url)
    if snap is not None:
        snap.note(rel, size)


def _bucket_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def _size(data: bytes | IO[bytes]) -> int:
    return len(data) if isinstance(data, bytes) else os.fstat(data.fileno()).st_size


def _md5(data: bytes | IO[bytes]) -> str:
    import hashlib  # noqa: PLC0415 - after a 412 only

    if isinstance(data, bytes):
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    data.seek(0)
    digest = hashlib.file_digest(data, lambda: hashlib.md5(usedforsecurity=False))  # type: ignore[arg-type]
    data.seek(0)
    return digest.hexdigest()


def _memory_etag(fs: Any, path: str) -> str:
    """memory:// has no ETag: its content's sha256 stands for one."""
    import hashlib  # noqa: PLC0415 - memory:// only (tests)

    try:
        return hashlib.sha256(fs.cat_file(path)).hexdigest()
    except FileNotFoundError:
        return ""


def _cause(exc: BaseException) -> Any:
    cause = exc.__cause__
    return getattr(cause, "response", None) or getattr(exc, "response", None) or {}


def _code(exc: BaseException) -> str:
    return str((_cause(exc).get("Error") or {}).get("Code") or "")


def _message(exc: BaseException) -> str:
    error = _cause(exc).get("Error") or {}
    return str(error.get("Message") or exc)


def _precondition(exc: BaseException) -> bool:
    """A 412 answer (If-None-Match / If-Match not met): s3fs maps it to FileExistsError or an OSError(EINVAL)."""
    if isinstance(exc, FileExistsError):
        return True
    status = (_cause(exc).get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412


def _no_bucket(exc: BaseException) -> bool:
    return _code(exc) == "NoSuchBucket" or "NoSuchBucket" in str(exc) or "bucket does not exist" in str(exc).lower()


def root(out: str | Path | StoreOut) -> Path | StoreOut:
    """OUT as the door takes it: a `StoreOut` for a URL (or a StoreOut), else a local `pathlib.Path`."""
    if isinstance(out, StoreOut):
        return out
    if isinstance(out, str) and is_url(out):
        return StoreOut.of(out)
    return Path(out)
