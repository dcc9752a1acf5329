"""Processes by PID, once: is this PID still the process we recorded, and stop one (TERM, wait, KILL).

A PID alone is not a process: the kernel reuses numbers, and an ended child stays a zombie until it is reaped.
A process is taken for the one recorded only when it is alive, not a zombie, and started when the record says
(psutil's create time, to 10 ms). The writer lock (`infra.cache.lock`), the server of `latentforge server`
(`infra.ops.server`) and the embedded server's reaper (`infra.ops.ephemeral`) all ask through here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys
from collections.abc import Callable

import psutil

#: Two readings of one process's start time differ by less than this (psutil rounds to the clock tick).
SAME_START_S = 0.01
#: ``PR_SET_PDEATHSIG`` of <linux/prctl.h>: the signal a child gets when the thread that started it ends.
PR_SET_PDEATHSIG = 1


def create_time(pid: int) -> float | None:
    """The start time of process `pid`, None when there is no such process (or it cannot be read)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: int, create_time: float | None) -> psutil.Process | None:
    """Process `pid` when it still is the one recorded: alive, not a zombie, started at `create_time` (None: any
    start time, for a record that has none). None otherwise."""
    if type(pid) is not int or not 0 < pid < 2**31:  # a record read back that names no process (a bool, -1, "7")
        return None
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        if create_time is not None and not abs(process.create_time() - create_time) <= SAME_START_S:  # NaN: not it
            return None
        return process
    except (psutil.Error, TypeError):
        return None


def stop(process: psutil.Process, timeout: float) -> bool:
    """SIGTERM `process`, wait up to `timeout` s, then SIGKILL it; True when it had to be killed. A process that
    is gone already (or goes meanwhile) counts as stopped."""
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout)
        return False
    except psutil.TimeoutExpired:
        pass
    except psutil.NoSuchProcess:
        return False
    try:
        process.kill()
        process.wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    return True


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent `sig` when its parent ends, even by SIGKILL (Linux
    ``prctl(PR_SET_PDEATHSIG)``, through libc); None where there is no such call (other systems: there the
    records of `infra.ops.ephemeral` and its reaper are the only guard). The signal comes when the *thread*
    that started the child ends: start it from a thread that lives as long as the run (the main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec
