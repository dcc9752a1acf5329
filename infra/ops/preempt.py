"""Preemption of a terminal run: SIGTERM, Ctrl-C (SIGINT) or a closed terminal (SIGHUP) stop it cleanly.

The first signal only asks: each shard finishes the sample in flight, seals its ledger and stops; no new shard
or step starts; the command ends with `EXIT_PREEMPTED` and one ``error: ...`` line saying how to resume (the
same command again). If that takes longer than the grace period (``--grace-seconds``), or a second signal comes,
the process ends at once instead: the sample in flight is abandoned (its temp file removed), each running shard's
ledger is sealed from its journal, the writer lock's record is cleared, the ephemeral Prefect server stopped,
and the same line printed, with the same exit code. Either way a rerun resumes from the sealed ledgers.

Handlers are installed by the terminal front (`flows.terminal_run.run_flow`), in the main thread; Prefect's flow engine
puts its own SIGTERM handler in place while a flow runs, so the flow takes ours back (`reclaim`) first thing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from infra import storage
from infra.cache import lock
from infra.errors import EXIT_PREEMPTED, Preempted
from infra.ops import ephemeral

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds of the grace kept for the immediate exit itself (seal from journals, stop the server).
HARD_EXIT_RESERVE = 2.0
RESUME = "to resume, run the same command again"

_state: dict[str, Any] = {
    "signal": None, "at": None, "grace": None, "announced": False, "installed": False, "waiting": 0, "timer": None,
}  # fmt: skip
_stop = threading.Event()
_cleanups: dict[int, Callable[[], None]] = {}
_cleanups_lock = threading.Lock()


def requested() -> str | None:
    """The name of the signal that asked this run to stop (SIGTERM, SIGINT, SIGHUP), or None."""
    return _state["signal"] if _stop.is_set() else None


def message() -> str:
    """The one line a preempted run ends with."""
    name = _state["signal"] or "a signal"
    return f"interrupted by {name}: finished samples are sealed in their shard ledgers; {RESUME}: it resumes"


def error() -> Preempted:
    """The error that ends a preempted run (its message is the resume line; printed once, by the CLI)."""
    _state["announced"] = True
    return Preempted(message())


def check() -> None:
    """Raise Preempted when a stop was asked for (flows call it between steps). Its message is short: the
    resume line is the terminal front's to print, once (`error`)."""
    if requested():
        raise Preempted(f"stopped by {requested()}")


def finish() -> None:
    """After the flow: raise the preempted run's error (its message is the resume line) when a stop was asked."""
    if requested():
        raise error()


@contextlib.contextmanager
def cleanup(action: Callable[[], None]) -> Iterator[None]:
    """Run `action` if the process is ended at once while the block runs (a shard: seal from its journal)."""
    key = id(action)
    with _cleanups_lock:
        _cleanups[key] = action
    try:
        yield
    finally:
        with _cleanups_lock:
            _cleanups.pop(key, None)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """While the block runs the run waits for a person (a pause, a prompt) with nothing in flight: a stop signal
    then ends it at once (`hard_exit`), not after the grace period."""
    _state["waiting"] += 1
    try:
        yield
    finally:
        _state["waiting"] -= 1


def _handler(signum: int, frame: FrameType | None) -> None:
    del frame
    if _stop.is_set():
        hard_exit(f"second signal ({signal.Signals(signum).name})")
    _state["signal"], _state["at"] = signal.Signals(signum).name, time.monotonic()
    _stop.set()
    if _state["waiting"]:
        hard_exit(f"{_state['signal']} while waiting for a person (nothing in flight)")
    grace = float(_state["grace"] or 0)
    delay = max(grace - HARD_EXIT_RESERVE, grace / 2)
    timer = threading.Timer(delay, hard_exit, args=(f"grace period of {grace:g} s over",))
    timer.daemon = True
    timer.start()
    _state["timer"] = timer
    _say(
        f"latentforge: {_state['signal']}: stopping after the samples in flight (at most {grace:g} s; "
        "a second signal stops at once)\n"
    )


def _say(text: str) -> None:
    """Write to stderr without the logging machinery (a signal handler may interrupt a thread holding its lock)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode(errors="replace"))


def hard_exit(why: str) -> None:
    """End the process now, leaving a resumable cache: seal the running shards from their journals, remove temp
    files in flight, clear the writer lock's record, stop the embedded server, print the resume line once."""
    with _cleanups_lock:
        actions = list(_cleanups.values())
    for action in actions:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the journal stays: a rerun reads it just as well
            _say(f"latentforge: could not seal a ledger on exit ({type(exc).__name__}: {exc}); its journal is kept\n")
    storage.discard_in_flight()
    lock.clear_held()
    ephemeral.stop_own(timeout=1.0)
    _say(f"latentforge: {why}: stopping now\n")
    if not _state["announced"]:
        _state["announced"] = True
        _say(f"error: {message()}\n")
    os._exit(EXIT_PREEMPTED)


def _install() -> dict[int, Any]:
    previous = {}
    for signum in SIGNALS:
        with contextlib.suppress(ValueError, OSError):  # not the main thread, or a platform without it
            previous[signum] = signal.signal(signum, _handler)
    return previous


@contextlib.contextmanager
def handling(grace_seconds: float) -> Iterator[None]:
    """Stop cleanly on SIGTERM / SIGINT / SIGHUP while the block runs (main thread only; a no-op elsewhere). Each
    block starts with no stop asked for, and its end calls off the grace period's watchdog: a process that runs
    several commands (a test's, a notebook's) goes on after a stopped one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reset()
    _state.update(grace=grace_seconds, installed=True)
    previous = _install()
    try:
        yield
    finally:
        _state["installed"] = False
        if (timer := _state["timer"]) is not None:
            timer.cancel()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def reclaim() -> None:
    """Inside a flow run: put the handlers back over Prefect's own SIGTERM handler (which would crash the run
    mid-sample); a no-op outside a terminal run or off the main thread."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        _install()


def reset() -> None:
    """Forget a stop request (tests, and a process that runs several commands)."""
    _stop.clear()
    if (timer := _state["timer"]) is not None:
        timer.cancel()
    _state.update(signal=None, at=None, announced=False, waiting=0, timer=None)
