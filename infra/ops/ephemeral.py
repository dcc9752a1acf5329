"""The embedded Prefect server of a terminal run: latentforge's own child, recorded, reaped, ended with the run.

With ``PREFECT_API_URL`` set, a terminal run uses that API and starts nothing. Otherwise `embedded_api` starts the
server `latentforge server start` runs (``prefect server start``, `infra.ops.server`; here without its UI and
worker) on a free loopback port as the run's child: in a session of its own (a Ctrl-C at the terminal reaches only
the run, which then stops the server itself), sent SIGTERM by the kernel when the run ends however it ends (Linux:
a parent-death signal), and recorded in ``PREFECT_HOME/latentforge-ephemeral/<server pid>.json`` with its owner
(pid and kernel start time of both, so a reused pid is never taken for ours). The run's flows reach it through
Prefect's public ``temporary_settings``; the server is stopped when the run ends (SIGTERM, wait, SIGKILL). Where
no parent-death signal exists (macOS), a run killed by SIGKILL leaves its server running: the next terminal run
with the same Prefect home reaps every recorded server whose owner is gone.

Why not Prefect's own ephemeral mode (``SubprocessASGIServer``): it starts its server from whichever thread first
needs the API, with a ``Popen`` latentforge cannot give a session or a parent-death signal without patching
Prefect, so its server outlives a killed run until a reaper comes. Measured here (2 cores), ``prefect server start``
answers after ~8 s on a used Prefect home (~17 s on a new one: the migrations), as Prefect's own start does
(5-8 s, 10-15 s): nothing is lost by owning the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    PREFECT_UI_URL,
    temporary_settings,
)

from infra import procs, records
from infra.errors import ServerError
from infra.ops import server
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

RECORD_DIR = "latentforge-ephemeral"
HOST = "127.0.0.1"
#: What a recorded server's command line holds: ours (``prefect server start``), or the uvicorn app of the
#: servers recorded by latentforge before 0.3 (Prefect's own ephemeral start); a process without it is not signalled.
SERVER_MARKS = (" server start ", "prefect.server.api.server:create_app")
#: The least time the embedded server gets to answer its health check (a first start on a loaded machine has taken
#: over 40 s). A longer PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS wins.
MIN_STARTUP_TIMEOUT = 120
#: Seconds the server gets to stop after SIGTERM at the run's end before SIGKILL.
STOP_TIMEOUT = 10.0
#: Seconds Prefect's log and event workers get to send what they hold before the server stops.
DRAIN_TIMEOUT = 10.0


@dataclass
class ServerRecord:
    """One embedded server and the run that started it."""

    server_pid: int
    server_create_time: float
    owner_pid: int
    owner_create_time: float
    host: str
    port: int | None
    started_at: str


def records_dir(home: Path | None = None) -> Path:
    """``PREFECT_HOME/latentforge-ephemeral`` (Prefect's resolved home unless given)."""
    return Path(home or PREFECT_HOME.value()).expanduser() / RECORD_DIR


def read_records(home: Path | None = None) -> list[tuple[Path, ServerRecord | None]]:
    """Every record file, with its record (None when it cannot be read)."""
    directory = records_dir(home)
    found: list[tuple[Path, ServerRecord | None]] = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            found.append((path, _record(path)))
        except (OSError, records.DamagedRecord):
            found.append((path, None))
    return found


#: What an embedded-server record that does not read back is left as: a person's (its server may still run).
LEFT = "left as it is: stop the server it named by hand, if it runs, then remove the file"


def _record(path: Path) -> ServerRecord:
    """One record file read back bounded (`infra.records`), its fields of their types; DamagedRecord otherwise."""
    where, what = str(path), "an embedded-server record"
    value = records.loads(path.read_bytes(), where, what, LEFT, records.MAX_SMALL_BYTES)
    return records.dataclass_of(ServerRecord, value, where, what, LEFT)


def _server_of(record: ServerRecord) -> psutil.Process | None:
    """The recorded server when it still runs: the same process, running a Prefect server."""
    process = procs.same_process(record.server_pid, record.server_create_time)
    try:
        command = f" {' '.join(process.cmdline())} " if process is not None else ""
    except psutil.Error:
        return None
    return process if any(mark in command for mark in SERVER_MARKS) else None


def _forget(path: Path, record: ServerRecord) -> None:
    path.unlink(missing_ok=True)
    path.with_name(f"server-{record.port}.log").unlink(missing_ok=True)


def reap_orphans(home: Path | None = None, timeout: float = STOP_TIMEOUT) -> list[ServerRecord]:
    """Stop every recorded embedded server of this host whose owner is gone; returns those stopped.

    A record whose server is gone already is removed; one of a live owner, or of another host, is left alone;
    an unreadable one is reported and left."""
    reaped = []
    for path, record in read_records(home):
        if record is None:
            try:
                _record(path)
            except (OSError, records.DamagedRecord) as exc:  # one line: the file, why, what is left to a person
                logger.warning("%s", exc)
            continue
        if record.host != socket.gethostname() or procs.same_process(record.owner_pid, record.owner_create_time):
            continue
        process = _server_of(record)
        if process is not None:
            logger.warning(
                "stopping an orphaned ephemeral Prefect server (pid %d, port %s) left by run pid %d, which is "
                "gone (killed?)",
                record.server_pid,
                record.port,
                record.owner_pid,
            )
            procs.stop(process, timeout)
            reaped.append(record)
        _forget(path, record)
    return reaped


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


def api_url(port: int) -> str:
    """The API URL of the embedded server on `port`."""
    return f"http://{HOST}:{port}/api"


def _free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def embedded_api(home: Path | None = None) -> Iterator[str | None]:
    """The block's Prefect API: ``PREFECT_API_URL`` when set (yields None, starts nothing); otherwise the embedded
    server, started (orphans of killed runs in the same home reaped first), waited for, recorded, made the API of
    the block's Prefect clients (yields its URL), and stopped with its record when the block ends. The UI URL is
    blank for the block: the embedded server has no UI to link to."""
    if PREFECT_API_URL.value():
        yield None
        return
    home = Path(home or PREFECT_HOME.value()).expanduser()
    reap_orphans(home)
    records_dir(home).mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url, log = api_url(port), records_dir(home) / f"server-{port}.log"
    args = server.server_command(HOST, port, ui=False)
    proc = server.spawn(args, server.server_env(home, url), log, Path.cwd(), tied=True)
    record, path = record_server(proc.pid, port, home)
    try:
        _wait(proc, url)
        logger.info("embedded Prefect API at %s (pid %d), ended with this run", url, proc.pid)
        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_UI_URL: ""}):
            try:
                yield url
            finally:
                _drain()
    finally:
        process = _server_of(record)
        if process is not None:
            procs.stop(process, STOP_TIMEOUT)
        _forget(path, record)


def _wait(proc: server.Proc, url: str) -> None:
    """Until the server answers; ServerError (with its log's tail) when it exits first or takes too long."""
    timeout = max(MIN_STARTUP_TIMEOUT, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    try:
        server.wait_until(lambda: server.healthy(url), proc, f"the embedded Prefect API at {url}", timeout)
    except ServerError as exc:
        raise ServerError(
            f"{exc}\n(on a loaded machine raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run a server "
            "with `latentforge server start` and point PREFECT_API_URL at it)"
        ) from exc


def _drain() -> None:
    """Let Prefect's log and event workers send what they hold while the server still answers (as Prefect's own
    test harness does before it stops its server): otherwise they fail against a stopped server at exit."""
    APILogWorker.drain_all(timeout=DRAIN_TIMEOUT)
    EventsWorker.drain_all(timeout=DRAIN_TIMEOUT)


def is_embedded(url: str | None, home: Path | None = None) -> bool:
    """Whether `url` is the API of the embedded server this process started: only this process can answer a
    question asked there (no UI, and no other process knows the server)."""
    if not url:
        return False
    me = os.getpid()
    return any(r is not None and r.owner_pid == me and api_url(r.port or 0) == url for _, r in read_records(home))


def stop_own(timeout: float = 1.0, home: Path | None = None) -> list[ServerRecord]:
    """Stop this process's embedded servers now (SIGTERM, SIGKILL after `timeout`) and drop their records: for an
    immediate exit, where `embedded_api`'s own stop will not run. Returns those stopped."""
    me, stopped = os.getpid(), []
    for path, record in read_records(home):
        if record is None or record.owner_pid != me:
            continue
        process = _server_of(record)
        if process is not None:
            procs.stop(process, timeout)
            stopped.append(record)
        _forget(path, record)
    return stopped
