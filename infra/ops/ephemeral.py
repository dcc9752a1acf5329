"""The ephemeral Prefect server of a terminal run: recorded by PID, reaped when the run that started it is gone.

With no ``PREFECT_API_URL``, Prefect 3.9 starts its API as a child process (``SubprocessASGIServer``:
``python -m uvicorn ... prefect.server.api.server:create_app`` on 127.0.0.1, a random port in 8000-8999) the
first time a client needs it, and stops it from an ``atexit`` hook. A process killed by SIGKILL or the OOM
killer runs no hook: the child lives on, holding its port, ~300 MB and the SQLite database of the Prefect
home. Prefect offers no parent-death signal for it (its ``Popen`` is not ours to change), so latentforge
starts that server itself, in the main thread, before the flow (Prefect then reuses the same instance), and
records it in ``PREFECT_HOME/latentforge-ephemeral/<server pid>.json`` with its owner: pid and kernel start
time of both, so a reused pid is never taken for ours. The next terminal run with the same Prefect home
reaps every recorded server whose owner is gone (SIGTERM, then SIGKILL) before it starts its own.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from infra.cache.storage import atomic_write
from infra.errors import ServerError

logger = logging.getLogger(__name__)

RECORD_DIR = "latentforge-ephemeral"
#: What Prefect's ephemeral server runs (its command line must hold this before it is signalled).
SERVER_APP = "prefect.server.api.server:create_app"
#: The least time the embedded server gets to answer its health check (Prefect's own default, 20 s, is not enough
#: on a loaded machine: there a first start has taken over 40 s). A longer
#: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS wins.
MIN_STARTUP_TIMEOUT = 120

#: This process's own tracked server and its record file (set by `start_tracked`).
_own: tuple[ServerRecord, Path] | None = None


@dataclass
class ServerRecord:
    """One ephemeral server and the run that started it."""

    server_pid: int
    server_create_time: float
    owner_pid: int
    owner_create_time: float
    host: str
    port: int | None
    started_at: str


def records_dir(home: Path | None = None) -> Path:
    """``PREFECT_HOME/latentforge-ephemeral`` (Prefect's resolved home unless given)."""
    if home is None:
        from prefect.settings import PREFECT_HOME  # noqa: PLC0415 - keep this module light for tests

        home = Path(PREFECT_HOME.value())
    return Path(home).expanduser() / RECORD_DIR


def _matches(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` when it still is the one recorded: alive, not a zombie, the same start time."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - create_time) > 0.01:
            return None
        return process
    except psutil.Error:
        return None


def read_records(home: Path | None = None) -> list[tuple[Path, ServerRecord | None]]:
    """Every record file, with its record (None when it cannot be read)."""
    directory = records_dir(home)
    found: list[tuple[Path, ServerRecord | None]] = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            found.append((path, ServerRecord(**json.loads(path.read_text()))))
        except (OSError, ValueError, TypeError):
            found.append((path, None))
    return found


def _stop(process: psutil.Process, timeout: float) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except psutil.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def reap_orphans(home: Path | None = None, timeout: float = 10.0) -> list[ServerRecord]:
    """Stop every recorded ephemeral server of this host whose owner is gone; returns those stopped.

    A record whose server is gone already is removed; one of a live owner, or of another host, is left alone;
    an unreadable one is reported and left."""
    reaped = []
    for path, record in read_records(home):
        if record is None:
            logger.warning("unreadable ephemeral-server record %s: left as it is", path)
            continue
        if record.host != socket.gethostname() or _matches(record.owner_pid, record.owner_create_time):
            continue
        server = _matches(record.server_pid, record.server_create_time)
        with contextlib.suppress(psutil.Error):
            if server is not None and SERVER_APP in " ".join(server.cmdline()):
                logger.warning(
                    "stopping an orphaned ephemeral Prefect server (pid %d, port %s) left by run pid %d, which is "
                    "gone (killed?)",
                    record.server_pid,
                    record.port,
                    record.owner_pid,
                )
                _stop(server, timeout)
                reaped.append(record)
        path.unlink(missing_ok=True)
    return reaped


def start_tracked(home: Path | None = None, while_starting: Callable[[], None] | None = None) -> ServerRecord | None:
    """Start Prefect's ephemeral server now (main thread) and record it; None when an API URL is set (or the
    ephemeral server is switched off). A server spawned at the command's start (`infra.ops.early`) is taken over
    when the settings are the spawn's: then only its answer is waited for.

    `while_starting` runs on a thread of its own from the moment the server's process is spawned (or taken over)
    until the server answers (its imports and database set-up take seconds of CPU of their own), so the run's own
    start-up work overlaps them instead of waiting behind them. It must not touch Prefect's API; it is joined
    before this returns, so nothing runs beside the flow. Nothing runs it when there is no server to wait for."""
    from prefect.server.api.server import SubprocessASGIServer  # noqa: PLC0415
    from prefect.settings import (  # noqa: PLC0415
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    from infra.ops import early  # noqa: PLC0415

    api_url, enabled = PREFECT_API_URL.value(), PREFECT_SERVER_EPHEMERAL_ENABLED.value()
    spawned = early.take(Path(home or PREFECT_HOME.value()), api_url, bool(enabled))
    if api_url or not enabled:
        return None  # a real server, or none at all: Prefect's own error then says so
    server = SubprocessASGIServer()  # Prefect keeps one per process: its clients get this one
    if spawned is not None and server.running:  # this process has its server already
        early.discard(spawned)
        spawned = None
    timeout = max(MIN_STARTUP_TIMEOUT, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    beside = _Beside(while_starting)
    if spawned is not None:
        _hand_over(server, spawned)
        beside.start()  # its process exists already
    try:
        with _own_session(on_spawn=beside.start):
            server.start(timeout=timeout)
    except RuntimeError as exc:
        if spawned is not None:
            spawned.path.unlink(missing_ok=True)  # Prefect's stop at exit ends the process
        raise ServerError(
            f"the embedded Prefect API did not answer within {timeout} s ({str(exc).splitlines()[0]}): on a loaded "
            "machine raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run a server (`latentforge server "
            "start`) and point PREFECT_API_URL at it"
        ) from exc
    finally:
        beside.join()
        answered = server.server_process.pid if server.server_process is not None else None
        if spawned is not None and answered != spawned.record.server_pid:
            early.discard(spawned)  # not the one that answered (its port was taken meanwhile), or none did
            spawned = None
    if server.server_process is None:
        return None
    if spawned is not None:
        record, path = spawned.record, spawned.path
    else:
        record, path = record_server(server.server_process.pid, server.port, home)
    atexit.register(path.unlink, missing_ok=True)  # runs before Prefect's own stop (atexit is LIFO)
    global _own
    _own = (record, path)
    return record


def record_server(pid: int, port: int | None, home: Path | None = None) -> tuple[ServerRecord, Path]:
    """Record this process's server `pid` in the home's record directory: (the record, its file)."""
    me = psutil.Process(os.getpid())
    record = ServerRecord(
        server_pid=pid,
        server_create_time=psutil.Process(pid).create_time(),
        owner_pid=me.pid,
        owner_create_time=me.create_time(),
        host=socket.gethostname(),
        port=port,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    path = records_dir(home) / f"{pid}.json"
    atomic_write(path, json.dumps(asdict(record)).encode(), replace=True)
    return record, path


def _hand_over(server: Any, spawned: Any) -> None:
    """Let Prefect's own `SubprocessASGIServer.start` wait for the early-spawned process: its first spawn returns
    that process, on its port; a later one (uvicorn exits 3 when it found its port taken, and Prefect then picks
    another port) is Prefect's own. Its clients use whichever answers."""
    first = [spawned.process]
    own_spawn = server._run_uvicorn_command  # Prefect 3.9's one spawn point
    server.port = spawned.record.port
    server._run_uvicorn_command = lambda: first.pop() if first else own_spawn()


class _Beside:
    """`work` on a thread started once (at the server's spawn), joined when the server answers or fails."""

    def __init__(self, work: Callable[[], None] | None) -> None:
        self._work, self._thread = work, None

    def start(self) -> None:
        if self._work is not None and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="lf-start-up", daemon=True)
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


@contextlib.contextmanager
def _own_session(on_spawn: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Start the server in a session of its own: a Ctrl-C at the terminal (SIGINT to the whole foreground process
    group) then reaches only latentforge, which finishes its sample and stops the server itself, instead of the
    server dying under the run's feet. Prefect's Popen is not ours, so its `subprocess.Popen` is wrapped for the
    moment of the start (see `flows.run.run_flow`): only the main thread's spawns (the server's) get the session,
    and `on_spawn` is called after each (the start-up thread starts once the server's process exists)."""
    from prefect.server.api import server as prefect_server  # noqa: PLC0415

    original = prefect_server.subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return original(*args, **kwargs)
        process = original(*args, **{**kwargs, "start_new_session": True})
        on_spawn()
        return process

    prefect_server.subprocess.Popen = popen  # type: ignore[misc]
    try:
        yield
    finally:
        prefect_server.subprocess.Popen = original  # type: ignore[misc]


def stop_own(timeout: float = 1.0) -> ServerRecord | None:
    """Stop this process's tracked server now (SIGTERM, SIGKILL after `timeout`) and drop its record: for an
    immediate exit, where Prefect's atexit stop will not run. None when there is none (or it is gone)."""
    global _own
    if _own is None:
        return None
    record, path = _own
    _own = None
    server = _matches(record.server_pid, record.server_create_time)
    if server is not None:
        with contextlib.suppress(psutil.Error):
            _stop(server, timeout)
    path.unlink(missing_ok=True)
    return record
