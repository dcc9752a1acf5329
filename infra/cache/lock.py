"""One writer per cache: an advisory lock on OUT/.latentforge.lock, released when the process ends.

The kernel lock (``flock``) is what excludes a second writer; the file's content says who holds it: a JSON
record (pid, host, the pid's start time, since when), written on taking the lock and cleared on a clean
release. A record found under a free lock is therefore a run that ended without releasing (SIGKILL, OOM,
a lost machine): on this host, when that pid is gone, the lock is taken over with a warning; a record of
another host cannot be checked from here, so the run stops and says how to clear it.

``flock`` is only as good as the file system: on a network file system (NFS, SMB, ...) a lock taken on one
machine may not exclude a writer on another. `lock_caveat` says so, from the mount table, and the warning is
logged whenever such an OUT is locked.

An OUT in an object store has no kernel lock: its lock is a lease, the object ``.latentforge.lock`` holding the
owner's record and when its lease ends (`LEASE_SECONDS` ahead). It is taken with a conditional put (``If-None-Match:
*``), renewed by a heartbeat thread every `HEARTBEAT_SECONDS` (``If-Match`` on the ETag of our last put), and deleted
on release. A live lease of another owner stops the run (LockedError); an expired one, or one of a process of this
host that is gone, is taken over with ``If-Match`` on the ETag read, so two runs taking over at once cannot both win.
A run whose heartbeat finds its lease taken (the ``If-Match`` refused), or that could not renew it before it ran out,
stops writing at once: every later put of the process below that OUT is refused (`infra.outstore.lose`: LeaseLost,
one line). The lease's record holds a token of its own (the same through its renewals): a Ray worker's shard task
writes for the run that holds the lease (`follow`), and reads the lease before each of its writes below OUT, which it
refuses (LeaseLost) once the token there is not the run's. ``LATENTFORGE_LEASE_SECONDS`` sets the lease (the heartbeat
is a quarter of it; from 1 s to a day, `infra.bounds`): tests shorten it.

A lock or lease record that does not read back as ours (not JSON, nested deep, an owner or an expiry of another type,
an expiry further ahead than the longest lease) is a **hold**: nothing proves that its run has ended, so it is never
taken over; the run stops with one line naming the record and the command that clears it once a person knows no run
is writing OUT. An expiry in another valid form is read as what it says (another zone; no zone: UTC, as ours are).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil

from infra import outdir, outstore, procs, records
from infra.bounds import MAX_LEASE_SECONDS, MIN_LEASE_SECONDS, seconds_between
from infra.errors import ConflictError, LeaseLost, OutWriteError
from infra.outstore import StoreOut

logger = logging.getLogger(__name__)

LOCK_NAME = ".latentforge.lock"
#: File systems whose locks are not known to hold between machines (checked against the mount table).
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "sshfs", "9p", "afs", "fuse.gcsfuse", "fuse.s3fs")
#: A lock held for a moment by another run's `check_not_locked` probe is waited for this long.
BUSY_WAIT_SECONDS = 1.0

#: The lock files this process holds (fd → OUT): `clear_held` empties their records before an immediate exit.
_held: dict[int, Path] = {}
#: How long a lease in an object store holds without renewal, and how often its heartbeat renews it.
LEASE_SECONDS = 120.0
HEARTBEAT_SECONDS = 30.0
#: Another lease length in seconds (the heartbeat a quarter of it): how the tests see a lease run out in seconds.
LEASE_ENV = "LATENTFORGE_LEASE_SECONDS"
#: The leases this process holds in object stores: `clear_held` deletes them before an immediate exit.
_leases: set[_Lease] = set()


class LockedError(ConflictError):
    """Another run holds OUT's writer lock (or left a record this host cannot check)."""


@dataclass
class LockOwner:
    """Who holds (or last held, without releasing) a cache's writer lock."""

    pid: int
    host: str
    create_time: float | None  # psutil's start time of that pid: a reused pid is not the holder
    since: str

    @classmethod
    def me(cls) -> LockOwner:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), procs.create_time(pid), _now())

    def text(self) -> str:
        return f"pid {self.pid} on {self.host} (since {self.since})"

    def alive_here(self) -> bool:
        """This owner is a running process of this host (same pid, same start time, not a zombie)."""
        return self.host == socket.gethostname() and procs.same_process(self.pid, self.create_time) is not None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _read_owner(fd: int, where: str) -> LockOwner | None:
    """The owner recorded in the lock file open at `fd` (None: no record); a record that does not read back as ours
    is a `records.DamagedRecord` naming `where` and the command that clears it (a hold)."""
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return None
    if raw.strip().isdigit():  # latentforge 0.1 wrote the bare pid
        return LockOwner(int(raw.strip()), socket.gethostname(), None, "?")
    repair = f"if no run is writing OUT, remove it (rm -- {shlex.quote(where)}) and run again"
    return owner_of(records.loads(raw, where, WHAT, repair, records.MAX_SMALL_BYTES), where, repair)


#: What a lock file or a lease object holds.
WHAT = "a lock record of latentforge's"


def owner_of(value: Any, where: str, repair: str = "") -> LockOwner:
    """The owner in a lock or lease record (parsed JSON), each field of its type; `records.DamagedRecord` otherwise
    (a pid that is no process id, a start time that is no finite number ...)."""
    if not isinstance(value, dict):
        raise records.damaged(where, WHAT, f"a JSON {type(value).__name__}, not an object", repair)
    pid, host, created, since = (value.get(key) for key in ("pid", "host", "create_time", "since"))
    if type(pid) is not int or not 0 < pid < 2**31:
        raise records.damaged(where, WHAT, f"its pid {str(pid)[:40]!r} is not a process id", repair)
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise records.damaged(where, WHAT, "its host is not a host name", repair)
    if created is not None and (type(created) not in (int, float) or not math.isfinite(created)):
        raise records.damaged(where, WHAT, f"its start time {str(created)[:40]!r} is not a number of seconds", repair)
    if not isinstance(since, str):
        raise records.damaged(where, WHAT, "its since is not a time", repair)
    return LockOwner(pid, host, None if created is None else float(created), since[:64])


def recorded_owner(out: Path | StoreOut) -> LockOwner | None:
    """The owner recorded in OUT's lock file or lease now; None when there is none, or none that reads back as ours."""
    where = outdir.shown(out, LOCK_NAME)
    try:
        return owner_of(
            records.loads(outdir.read_bytes(out, LOCK_NAME), where, WHAT, "", records.MAX_SMALL_BYTES), where
        )
    except (OSError, records.DamagedRecord, outdir.UnsafePath):
        return None


def lock_caveat(path: Path, partitions: Iterable[Any] | None = None) -> str | None:
    """Why OUT's lock cannot be trusted across machines (its mount is a network file system), else None.

    `partitions`: ``psutil.disk_partitions(all=True)`` unless given (entries with ``mountpoint``/``fstype``)."""
    resolved = str(Path(path).resolve())
    best = None
    for part in psutil.disk_partitions(all=True) if partitions is None else partitions:
        mount = part.mountpoint.rstrip("/") or "/"
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > len(best.mountpoint.rstrip("/") or "/")):
            best = part
    if best is None or best.fstype.lower() not in NETWORK_FS:
        return None
    return (
        f"{path} is on {best.fstype} ({best.device} at {best.mountpoint}): its writer lock is not known to "
        "exclude a build on another machine; run one build per OUT across machines"
    )


def _refusal(out: Path | StoreOut, owner: LockOwner | None) -> LockedError:
    holder = owner.text() if owner else "a process that has not written its record yet"
    return LockedError(f"{out} is being written by another run: {holder}; wait for it or use another --out")


def _holder(fd: int, out: Path) -> LockOwner | None:
    """Who holds the kernel lock by its record (None: no record, or none that reads back)."""
    try:
        return _read_owner(fd, str(out / LOCK_NAME))
    except records.DamagedRecord:
        return None


def _take(fd: int, out: Path) -> None:
    """flock OUT, waiting out a momentary probe; LockedError when another run holds it."""
    deadline = time.monotonic() + BUSY_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise _refusal(out, _holder(fd, out)) from None
            time.sleep(0.05)


def _take_over(out: Path, previous: LockOwner) -> None:
    """A record under a free lock: a run that did not release. Take over on this host when it is gone."""
    if previous.host != socket.gethostname():
        raise LockedError(
            f"{out} was last locked by {previous.text()} and never released; this host cannot tell whether that "
            f"run is still writing. If it is not, remove {out / LOCK_NAME} and run again"
        )
    if previous.alive_here():
        raise LockedError(f"{out}: {previous.text()} holds the lock by its record but not by the kernel's; stopping")
    logger.warning("taking over the writer lock of %s left by %s, which is gone (killed?)", out, previous.text())


@contextlib.contextmanager
def out_lock(out: Path | StoreOut) -> Iterator[None]:
    """Hold the cache's writer lock; a second writer gets a LockedError (naming this one's pid and host) at once.
    An OUT this lock created and nothing else wrote into (a run stopped at a gate) is removed again on release.
    Below an OUT in an object store: a lease (`_Lease`)."""
    if isinstance(out, StoreOut):
        with _Lease(out).held():
            yield
        return
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    caveat = lock_caveat(out)
    if caveat:
        logger.warning("%s", caveat)
    fd = outdir.open_fd(out, LOCK_NAME, os.O_RDWR | os.O_CREAT)  # a link planted in its place is refused
    recorded = False
    try:
        _take(fd, out)
        try:
            previous = _read_owner(fd, str(out / LOCK_NAME))
        except records.DamagedRecord as exc:  # a hold: the record is left as it was found
            raise LockedError(str(exc)) from None
        if previous is not None:
            _take_over(out, previous)  # a refusal leaves the record as it was found
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(LockOwner.me())).encode(), 0)
        os.fsync(fd)
        recorded = True
        _held[fd] = out
        yield
    finally:
        _held.pop(fd, None)
        if recorded:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a clean release leaves no record: a record means a run that died
        if created and [p.name for p in out.iterdir()] == [LOCK_NAME]:  # nothing written: leave nothing behind
            with contextlib.suppress(OSError):
                outdir.unlink(out, LOCK_NAME)
                out.rmdir()
        os.close(fd)  # closing releases the lock


def clear_held() -> list[Path | StoreOut]:
    """Empty the records of the locks this process holds (a clean release's mark) because it is about to end at
    once (a second signal, the grace expired); the kernel drops the locks themselves with the process. A lease in
    an object store is deleted."""
    cleared: list[Path | StoreOut] = []
    for lease in list(_leases):
        with contextlib.suppress(OSError):
            lease.release()
            cleared.append(lease.out)
    for fd, out in list(_held.items()):
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            cleared.append(out)
    return cleared


def check_not_locked(out: Path | StoreOut) -> None:
    """Before a run starts anything: LockedError when another run holds OUT's lock now (a shared probe)."""
    if isinstance(out, StoreOut):
        found = _read_lease(out)
        if found is not None and found.live():
            raise found.refusal(out)
        return
    try:
        fd = outdir.open_fd(out, LOCK_NAME, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(Path(out), _holder(fd, Path(out))) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Found:
    """A lease object as read: its owner, when it ends, its ETag; or why its record does not read back (a hold)."""

    owner: LockOwner
    expires: datetime
    etag: str
    damage: records.DamagedRecord | None = None

    def live(self) -> bool:
        """Held now: not expired, and not a process of this host that is gone; a record that does not read back is
        held (nothing proves its run ended)."""
        if self.damage is not None:
            return True
        gone_here = self.owner.host == socket.gethostname() and not self.owner.alive_here()
        return self.expires > datetime.now(UTC) and not gone_here

    def refusal(self, out: StoreOut) -> LockedError:
        """The one line that stops a run meeting this lease."""
        return LockedError(str(self.damage)) if self.damage is not None else _refusal(out, self.owner)


def lease_seconds() -> tuple[float, float]:
    """(the lease, its heartbeat) in seconds: `LEASE_SECONDS` / `HEARTBEAT_SECONDS`, or ``LATENTFORGE_LEASE_SECONDS``
    (bounded: `infra.bounds.MIN_LEASE_SECONDS` to `MAX_LEASE_SECONDS`) and a quarter of it."""
    raw = os.environ.get(LEASE_ENV)
    if not raw:
        return LEASE_SECONDS, HEARTBEAT_SECONDS
    lease = seconds_between(raw, LEASE_ENV, MIN_LEASE_SECONDS, MAX_LEASE_SECONDS)
    return lease, lease / 4


def clear_command(out: StoreOut) -> str:
    """The command that deletes OUT's lease object (what a person runs once no run is writing OUT)."""
    url = f"{out}/{LOCK_NAME}"
    tool = {"s3": "aws s3 rm", "s3a": "aws s3 rm", "gs": "gcloud storage rm", "gcs": "gcloud storage rm"}
    return f"{tool.get(out.scheme, 'delete the object')} -- {shlex.quote(url)}"


def _expiry(value: Any, where: str, repair: str) -> datetime:
    """A lease record's expiry: an ISO time (no zone: UTC, as latentforge writes them), not further ahead than the
    longest lease; `records.DamagedRecord` otherwise (a number, a bool, NaN, a time years ahead)."""
    if not isinstance(value, str):
        raise records.damaged(where, WHAT, f"its expiry {str(value)[:40]!r} is not an ISO time", repair)
    try:
        expires = datetime.fromisoformat(value)
    except ValueError:
        raise records.damaged(where, WHAT, f"its expiry {value[:40]!r} is not an ISO time", repair) from None
    expires = expires if expires.tzinfo is not None else expires.replace(tzinfo=UTC)
    if expires - datetime.now(UTC) > timedelta(seconds=MAX_LEASE_SECONDS + 60):
        why = f"its expiry {value[:40]} is further ahead than the longest lease ({MAX_LEASE_SECONDS:g} s)"
        raise records.damaged(where, WHAT, why, repair)
    return expires


def _read_lease(out: StoreOut) -> _Found | None:
    head = out.head(LOCK_NAME)
    if head is None:
        return None
    where, repair = f"{out}/{LOCK_NAME}", f"if no run is writing OUT, delete it ({clear_command(out)}) and run again"
    try:
        if head.size > records.MAX_SMALL_BYTES:
            raise records.damaged(where, WHAT, f"{head.size} bytes", repair, "size")
        record = records.loads(out.read_bytes(LOCK_NAME), where, WHAT, repair, records.MAX_SMALL_BYTES)
        owner = owner_of(record, where, repair)
        expires = _expiry(record.get("expires"), where, repair)
    except FileNotFoundError:
        return None
    except records.DamagedRecord as exc:  # not a record of ours: a hold (taken over by no run)
        return _Found(LockOwner(-1, "an unreadable record", None, "?"), datetime.now(UTC), head.etag, exc)
    return _Found(owner, expires, head.etag)


class _Lease:
    """This process's lease on an OUT in an object store (see the module's docstring)."""

    def __init__(self, out: StoreOut) -> None:
        self.out, self.etag = out, ""
        self.token = secrets.token_hex(16)  # this lease's, through its renewals (what a worker checks: `follow`)
        self.seconds, self.beat = lease_seconds()
        self._until = 0.0  # (monotonic) when the lease last put runs out
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _record(self) -> bytes:
        owner = asdict(LockOwner.me())
        expires = datetime.now(UTC) + timedelta(seconds=self.seconds)
        run = os.environ.get("PREFECT__FLOW_RUN_ID")
        record = {**owner, "expires": expires.isoformat(timespec="seconds"), "run": run, "token": self.token}
        return json.dumps(record).encode()

    def take(self) -> None:
        self._until = time.monotonic() + self.seconds
        try:
            self.etag = self.out.put(LOCK_NAME, self._record(), create=True)
            return
        except FileExistsError:
            pass
        found = _read_lease(self.out)
        if found is not None and found.live():
            raise found.refusal(self.out)
        try:
            if found is None:  # released meanwhile
                self.etag = self.out.put(LOCK_NAME, self._record(), create=True)
                return
            logger.warning(
                "taking over the lease of %s left by %s (expired, or its process is gone)", self.out, found.owner.text()
            )
            self.etag = self.out.put(LOCK_NAME, self._record(), match=found.etag)
        except FileExistsError:
            raise _refusal(self.out, None) from None  # another run took it over first

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.beat):
            sent = time.monotonic()
            try:
                self.etag = self.out.put(LOCK_NAME, self._record(), match=self.etag)
                self._until = sent + self.seconds
            except FileExistsError:
                found = _read_lease(self.out)
                holder = found.owner.text() if found is not None else "another run (released since)"
                self._lose(f"this run's lease was taken over by {holder}")
                return
            except (OSError, OutWriteError) as exc:  # a store error: tried again at the next beat while the lease holds
                if time.monotonic() >= self._until:
                    self._lose(f"this run's lease ran out unrenewed ({exc})")
                    return
                logger.warning("%s: the lease was not renewed (%s); trying again", self.out, exc)

    def _lose(self, why: str) -> None:
        """Refuse this process's every later write below OUT, with one line saying why (logged once here)."""
        message = _lost_line(self.out, why)
        if not self._stop.is_set():
            outstore.lose(self.out.url, message)
            logger.error("%s", message)

    def release(self) -> None:
        self._stop.set()
        _leases.discard(self)
        head = self.out.head(LOCK_NAME)
        if head is not None and head.etag == self.etag:  # still ours: a lease taken over is not deleted
            with contextlib.suppress(LeaseLost):  # one that ran out unrenewed is left as it is: nothing more is sent
                self.out.delete(LOCK_NAME)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.take()
        _leases.add(self)
        self._beat = threading.Thread(target=self._heartbeat, name="latentforge-lease", daemon=True)
        self._beat.start()
        try:
            yield
        finally:
            self._stop.set()
            self._beat.join(timeout=5)
            self.release()
            outstore.regain(self.out.url)


def _lost_line(out: StoreOut, why: str) -> str:
    return (
        f"{out}: {why}; this run stopped writing there (nothing more is put). If no other run is writing OUT, run the "
        "same command again: it resumes"
    )


def lease_of(out: Path | StoreOut) -> tuple[str, str] | None:
    """(OUT's URL, the lease's token) of the lease this process holds on the store OUT `out`; None for a local OUT
    or one this process holds no lease on. What a run hands its shard tasks in other processes (`follow`)."""
    for lease in list(_leases):
        if isinstance(out, StoreOut) and lease.out.url == out.url:
            return lease.out.url, lease.token
    return None


@contextlib.contextmanager
def follow(lease: tuple[str, str] | None) -> Iterator[None]:
    """In a process that writes below an OUT for a run holding its lease elsewhere (a Ray worker's shard task): while
    the block runs, each write below OUT first reads the lease (one GET) and is refused, with every later one
    (LeaseLost, the line the run's own process gives), once the lease is not the run's (another run took it over, or
    it is gone). A write whose check came just before a takeover is still sent: the store has no put conditional on
    another object. Nothing for None (a local OUT)."""
    if lease is None:
        yield
        return
    url, token = lease
    out = StoreOut(url)

    def check() -> str | None:
        where = f"{out}/{LOCK_NAME}"
        try:
            record = records.loads(out.read_bytes(LOCK_NAME), where, WHAT, "", records.MAX_SMALL_BYTES)
        except FileNotFoundError:
            return _lost_line(out, "this run's lease is gone (released or removed)")
        except records.DamagedRecord:
            record = {}
        if isinstance(record, dict) and record.get("token") == token:
            return None
        try:
            holder = owner_of(record, where).text()
        except records.DamagedRecord:
            holder = "another run (an unreadable record)"
        return _lost_line(out, f"this run's lease was taken over by {holder}")

    outstore.guard(url, check)
    try:
        yield
    finally:
        outstore.unguard(url)
