"""Kill points for the crash-resume sweep: ``LATENTFORGE_KILL_AT=POINT[:N]`` SIGKILLs this process the N-th
time (default 1) it reaches `fault_point(POINT)`; ``LATENTFORGE_FAULT_LOG=FILE`` appends every point reached to
FILE (how the sweep finds which hit of a point falls mid-run). Unset (always, outside the crash tests), a point
is two environment lookups. Points are chosen by progress, not by clock, so a kill lands where it is meant to
on any machine.

``LATENTFORGE_KILL_FILE=FILE`` kills, once, the first process to reach the point FILE names.
``LATENTFORGE_KILL_ON=POINT[:SIGNAL]=KEY`` kills the process (SIGKILL, or the signal named: ``SIGSEGV``) at every hit of
POINT while it is on sample KEY (a point reached with its sample's key): a sample that takes down every process that
decodes it, as a decoder crash on its bytes would (how a test makes a suspect's child die: ``suspect``).
``LATENTFORGE_FAIL_AT=POINT[:N]`` raises `InjectedFault` at the N-th hit of POINT and at every hit after it: a fault
that stays, as a device that broke mid-run does (how a test makes a shard's encodes fail from a chosen sample on).
``LATENTFORGE_HOLD_AT=POINT[:N]=FILE`` holds a process at POINT (only at its N-th hit, where N is given) while FILE
exists (at most `HOLD_MAX_S`): how a test signals a build at a chosen point, however fast the machine (the preemption
test holds it after its first sample).

Points: ``plan`` (planned, nothing written), ``sanity`` (the sanity sample encoded), ``decode`` (a sample's
frames decoded, not yet encoded), ``encode`` (encoded, not yet written), ``write`` (a file's bytes on disk
under its temporary name, not yet linked), ``sample`` (a row journalled: between samples), ``seal`` (a shard's
sealed ledger written, its journal not yet removed), ``part`` (a sample appended to an open shard part of the
webdataset or parquet format, the part not yet in place), ``shard`` (a shard done: between shards), ``verify`` (a
sample decoded back by decode-and-verify). Reached with a sample's key: ``suspect`` (a child decoding a suspect
alone, `infra.preprocess.alone`, before it decodes); in such a child before it says it is ready: ``suspect_start``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

ENV = "LATENTFORGE_KILL_AT"
LOG_ENV = "LATENTFORGE_FAULT_LOG"  # a file each point reached is appended to (the sweep's reference run)
POINTS = ("plan", "sanity", "decode", "encode", "write", "sample", "seal", "shard", "verify")
#: A file holding a point's name: the first process (of any on the host or shared file system) to reach that point
#: removes the file and is killed there, once (how a test kills one Ray worker mid-shard, whichever runs it).
KILL_FILE_ENV = "LATENTFORGE_KILL_FILE"
KILL_ON_ENV = "LATENTFORGE_KILL_ON"
HOLD_ENV = "LATENTFORGE_HOLD_AT"
FAIL_ENV = "LATENTFORGE_FAIL_AT"
HOLD_MAX_S = 120.0
#: Points only a shard format's build reaches (tests/test_shard_resume.py sweeps them).
SHARD_POINTS = ("part",)
_hits: Counter[str] = Counter()
_failing: Counter[str] = Counter()
_held: Counter[str] = Counter()  # hits per hold setting (a new FILE counts afresh: in-process tests run many builds)
_lock = threading.Lock()


def fault_point(name: str, key: str | None = None) -> None:
    """SIGKILL this process here if ``LATENTFORGE_KILL_AT`` names this point and this is its N-th hit, or if the
    ``LATENTFORGE_KILL_FILE`` names this point and this process is the first to claim it; kill it with the signal
    ``LATENTFORGE_KILL_ON`` names if it names this point and sample `key`."""
    if log := os.environ.get(LOG_ENV):
        with _lock, open(log, "a", encoding="utf-8") as fh:
            fh.write(name + "\n")
    if key is not None and (kill_on := os.environ.get(KILL_ON_ENV)):
        _kill_on(kill_on, name, key)
    if hold := os.environ.get(HOLD_ENV):
        _hold(hold, name)
    if (kill_file := os.environ.get(KILL_FILE_ENV)) and _claimed(kill_file, name):
        os.kill(os.getpid(), signal.SIGKILL)
    if fail := os.environ.get(FAIL_ENV):
        _fail(fail, name)
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    with _lock:
        _hits[name] += 1
        if _hits[name] == int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def _kill_on(spec: str, name: str, key: str) -> None:
    """Kill this process with SIGNAL if ``POINT[:SIGNAL]=KEY`` names point `name` and sample `key`."""
    where, _, wanted = spec.partition("=")
    point, _, signame = where.partition(":")
    if point == name and wanted == key:
        os.kill(os.getpid(), signal.Signals[signame or "SIGKILL"])


class InjectedFault(RuntimeError):
    """Raised by `LATENTFORGE_FAIL_AT` (tests only)."""


def _fail(spec: str, name: str) -> None:
    """Raise InjectedFault from the N-th hit of the point of ``POINT[:N]`` on (counted per setting)."""
    point, _, nth = spec.partition(":")
    if point != name:
        return
    with _lock:
        _failing[spec] += 1
        if _failing[spec] < int(nth or 1):
            return
    raise InjectedFault(f"fault injected at {name} (hit {_failing[spec]}, {FAIL_ENV}={spec})")


def _hold(spec: str, name: str) -> None:
    """Wait here while the file of ``POINT[:N]=FILE`` exists, if POINT is `name` (and this is its N-th hit, where N
    is given); released by removing the file."""
    where, _, path = spec.partition("=")
    point, _, nth = where.partition(":")
    if point != name:
        return
    if nth:
        with _lock:
            _held[spec] += 1
            if _held[spec] != int(nth):
                return
    deadline = time.monotonic() + HOLD_MAX_S
    while Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _claimed(kill_file: str, name: str) -> bool:
    """Whether this process takes the kill named in `kill_file` (renaming it away first: one taker only)."""
    try:
        with open(kill_file, encoding="utf-8") as fh:
            if fh.read().strip() != name:
                return False
        Path(kill_file).rename(f"{kill_file}.{os.getpid()}")
    except FileNotFoundError:
        return False
    return True
