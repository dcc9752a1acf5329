"""The ephemeral Prefect server of a terminal run: recorded by PID, reaped when the run that started it is gone.

With no ``PREFECT_API_URL``, Prefect 3.9 starts its API as a child process (``SubprocessASGIServer``:
``python -m uvicorn ... prefect.server.api.server:create_app`` on 127.0.0.1, a random port in 8000-8999) the
first time a client needs it, and stops it from an ``atexit`` hook. A process killed by SIGKILL or the OOM
killer runs no hook: the child lives on, holding its port, ~300 MB and the SQLite database of the Prefect
home. Prefect offers no parent-death signal for it (its ``Popen`` is not ours to change), so latentforge
starts that server itself before the flow (spawned at the command's start, `infra.ops.early`, and made the
process's API; else Prefect's own start, in the main thread, whose instance Prefect then reuses), and records
it in ``PREFECT_HOME/latentforge-ephemeral/<server pid>.json`` with its owner: pid and kernel start time of
both, so a reused pid is never taken for ours. The next terminal run with the same Prefect home
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
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from infra.errors import ServerError
from infra.storage import atomic_write

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
    """Make this process's ephemeral server answer before the flow, and record it; None when an API URL is set
    (or the ephemeral server is switched off). A server spawned at the command's start (`infra.ops.early`) is taken over
    when the settings are the spawn's (`_serve_early`); otherwise Prefect's own `SubprocessASGIServer` starts one.

    `while_starting` runs on a thread of its own from the moment the server's process is spawned (or taken over)
    until the server answers (its imports and database set-up take seconds of CPU of their own), so the run's own
    start-up work overlaps them instead of waiting behind them. It must not touch Prefect's API; it is joined
    before this returns, so nothing runs beside the flow. Nothing runs it when there is no server to wait for."""
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
    timeout = max(MIN_STARTUP_TIMEOUT, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    beside = _Beside(while_starting)
    if spawned is not None:
        record = _serve_early(spawned, timeout, beside)
        if record is not None:
            return record
    return _start_prefects(home, timeout, beside)


def _serve_early(spawned: Any, timeout: float, beside: _Beside) -> ServerRecord | None:
    """Wait for the early-spawned server to answer, then point every Prefect client of this process at it for the
    rest of the process (``PREFECT_API_URL``, process-wide; the UI URL blank: the embedded server has no UI), and
    stop it at exit. None when it exited first (uvicorn exits 3 when its port was taken during its start-up): it is
    discarded, and Prefect's own start follows, with its own retry on another port.

    Prefect's `SubprocessASGIServer` would wait for it too, but importing its module (``prefect.server.api.server``,
    the whole API app) costs ~3 s of the run's CPU, on the run's critical path; a client of a running server never
    imports it. Not taken when this thread is inside a settings context of its own (a caller's
    ``temporary_settings``: it would hide the process-wide URL), or when this process runs Prefect's ephemeral
    server already (its clients use that one)."""
    import prefect.context  # noqa: PLC0415

    from infra.ops import early  # noqa: PLC0415

    own_context = prefect.context.SettingsContext.get() is not prefect.context.GLOBAL_SETTINGS_CONTEXT
    if own_context or _prefect_server_running():
        early.discard(spawned, wait_s=1.0)
        return None
    url = f"http://127.0.0.1:{spawned.record.port}/api"
    beside.start()  # its process exists already
    try:
        answered = _answers(spawned.process, url, timeout)
    except ServerError:
        early.discard(spawned, wait_s=1.0)
        raise
    finally:
        beside.join()
    if not answered:
        early.discard(spawned, wait_s=1.0)
        return None
    _point_at(url)
    atexit.register(early.discard, spawned, wait_s=5.0)  # after Prefect's services drain (atexit is LIFO)
    global _own
    _own = (spawned.record, spawned.path)
    return spawned.record


def _prefect_server_running() -> bool:
    module = sys.modules.get("prefect.server.api.server")  # never imported for it: it is the cost avoided
    return module is not None and bool(module.SubprocessASGIServer().running)


def _answers(process: Any, url: str, timeout: float) -> bool:
    """Whether the server `process` answers ``url/health`` (`infra.ops.server.healthy`) before it exits;
    ServerError after `timeout`."""
    from infra.ops.server import healthy  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if healthy(url):
            return True
        time.sleep(0.1)
    raise ServerError(_TIMEOUT.format(timeout=timeout, why="no answer to its health check"))


def _point_at(api_url: str) -> None:
    """Prefect's process-wide settings (those of every thread without a context of its own) with `api_url`."""
    import prefect.context  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL  # noqa: PLC0415

    current = prefect.context.GLOBAL_SETTINGS_CONTEXT
    settings = current.settings.copy_with_update(updates={PREFECT_API_URL: api_url, PREFECT_UI_URL: ""})
    pointed = prefect.context.SettingsContext(profile=current.profile, settings=settings)
    prefect.context.GLOBAL_SETTINGS_CONTEXT = pointed


_TIMEOUT = (
    "the embedded Prefect API did not answer within {timeout} s ({why}): on a loaded machine raise "
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run a server (`latentforge server start`) and point "
    "PREFECT_API_URL at it"
)


def _start_prefects(home: Path | None, timeout: float, beside: _Beside) -> ServerRecord | None:
    """Prefect's own ephemeral start (`SubprocessASGIServer`, the one instance its clients use), recorded."""
    from prefect.server.api.server import SubprocessASGIServer  # noqa: PLC0415

    server = SubprocessASGIServer()  # Prefect keeps one per process: its clients get this one
    try:
        with _own_session(on_spawn=beside.start):
            server.start(timeout=int(timeout))
    except RuntimeError as exc:
        raise ServerError(_TIMEOUT.format(timeout=timeout, why=str(exc).splitlines()[0])) from exc
    finally:
        beside.join()
    if server.server_process is None:
        return None
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
