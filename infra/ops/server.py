"""A Prefect server, the process work pool and a worker on this host, started detached and stopped by PID.

`start` launches `prefect server start` and `prefect worker start` in their own sessions (process groups),
logs to files in the state directory and records both PIDs (with their kernel start times, so a reused PID
is not mistaken for ours) in ``server.json``. `stop` ends both groups (SIGTERM, then SIGKILL after a timeout).
One state directory per Prefect home, so several servers (other ports and homes) can run side by side.
Processes are checked with psutil (Linux and macOS): a zombie, or a PID reused by another process (another
create time), is not taken for ours. The UI is told the API URL of the server it belongs to, so it works on
any host and port.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil

from infra import procs, records
from infra.errors import ServerError
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

STATE_FILE = "server.json"
#: Each flow run heartbeats every 30 s, so infra/deploy/automations.yaml can mark a killed run Crashed.
#: (PREFECT_FLOWS_HEARTBEAT_FREQUENCY is the 3.9 name of PREFECT_RUNNER_HEARTBEAT_FREQUENCY.)
JOB_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass
class Proc:
    """One process we started: its PID (= its process group) and the kernel's start time of that PID."""

    pid: int
    create_time: float | None  # psutil's create time of that PID when we started it
    log: str


@dataclass
class ServerState:
    """What `start` recorded: enough for `status` and `stop`, and the URLs to print."""

    host: str
    port: int
    api_url: str
    ui_url: str
    pool: str
    home: str | None
    server: Proc
    worker: Proc
    started_at: str


@dataclass
class Status:
    """`status`: per process running or not, and whether the API answers."""

    state: ServerState
    server_running: bool
    worker_running: bool
    healthy: bool

    @property
    def running(self) -> bool:
        return self.server_running and self.worker_running and self.healthy

    @property
    def stale(self) -> bool:
        return not self.server_running and not self.worker_running


def resolve_home(home: Path | None) -> Path | None:
    """--home, else $PREFECT_HOME, else None (Prefect's own default, ~/.prefect)."""
    if home is not None:
        return Path(home).expanduser().absolute()
    env = os.environ.get("PREFECT_HOME")
    return Path(env).expanduser().absolute() if env else None


def state_dir(home: Path | None) -> Path:
    """``HOME/latentforge-server`` for a Prefect home, else ``~/.latentforge/server``."""
    return home / "latentforge-server" if home is not None else Path.home() / ".latentforge" / "server"


def read_state(directory: Path) -> ServerState | None:
    """The recorded state, None when nothing is recorded; ServerError when the file is not ours or damaged."""
    path = directory / STATE_FILE
    if not path.exists():
        return None
    repair = "stop the processes it named by hand and remove it"
    try:
        value = records.loads(path.read_bytes(), str(path), "a server state record", repair, records.MAX_SMALL_BYTES)
        return records.dataclass_of(ServerState, value, str(path), "a server state record", repair)
    except OSError as exc:
        raise ServerError(f"{path} is unreadable ({exc}); {repair}") from exc
    except records.DamagedRecord as exc:  # one line: the file, why, and what to do (its processes may still run)
        raise ServerError(f"unreadable: {exc}") from None


def write_state(directory: Path, state: ServerState) -> Path:
    """Atomic: a reader sees the old file or the new one."""
    return atomic_write(directory / STATE_FILE, json.dumps(asdict(state), indent=2).encode(), replace=True).path


def is_running(proc: Proc) -> bool:
    """The recorded process is alive: not gone, not a zombie, and the PID not reused by another process."""
    return procs.same_process(proc.pid, proc.create_time) is not None


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the process group?"""
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    """GET API/health answers 200."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def status(home: Path | None) -> Status | None:
    """The recorded server's status, or None when nothing is recorded for this home."""
    state = read_state(state_dir(home))
    if state is None:
        return None
    server_up = is_running(state.server)
    return Status(state, server_up, is_running(state.worker), server_up and healthy(state.api_url))


def remove_state(home: Path | None) -> None:
    (state_dir(home) / STATE_FILE).unlink(missing_ok=True)


def stop_group(proc: Proc, timeout: float) -> bool:
    """SIGTERM the process group, SIGKILL what is left after `timeout`; True when it had to kill.

    A PID now held by another process (other start time) means our group is long gone: Linux does not reuse a
    number while a process group still has it, so nothing is signalled then."""
    now = procs.create_time(proc.pid)
    reused = now is not None and proc.create_time is not None and abs(now - proc.create_time) > procs.SAME_START_S
    if reused or not _group_alive(proc.pid):
        return False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return sig == signal.SIGKILL
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(proc.pid):
                return sig == signal.SIGKILL
            time.sleep(0.2)
    raise ServerError(f"process group {proc.pid} survived SIGKILL")


def stop(home: Path | None, timeout: float = 20.0) -> ServerState | None:
    """Stop the worker, then the server, by their recorded process groups; remove the state file."""
    state = read_state(state_dir(home))
    if state is None:
        return None
    for name, proc in (("worker", state.worker), ("server", state.server)):
        if stop_group(proc, timeout):
            logger.warning("%s (pid %d) did not stop within %.0f s: killed", name, proc.pid, timeout)
    remove_state(home)
    return state


def _prefect() -> list[str]:
    """The `prefect` of this interpreter's environment."""
    script = Path(sys.executable).with_name("prefect")
    return [str(script)] if script.exists() else [sys.executable, "-m", "prefect"]


def server_command(host: str, port: int, *, ui: bool = True) -> list[str]:
    """``prefect server start`` on `host`:`port`: the server of `start`, and the embedded one of a terminal run
    (`infra.ops.ephemeral`, without the UI)."""
    return [*_prefect(), "server", "start", "--host", host, "--port", str(port), *([] if ui else ["--no-ui"])]


def server_env(home: Path | None, ui_api_url: str) -> dict[str, str]:
    """The server's environment: this one without an API URL (the server is the API), analytics off unless asked,
    the UI told its API's URL (unset, the UI calls 127.0.0.1:4200 on any port), `home` as its Prefect home."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env["PREFECT_SERVER_UI_API_URL"] = ui_api_url
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env


def spawn(args: list[str], env: dict[str, str], log: Path, cwd: Path, *, tied: bool = False) -> Proc:
    """Detached: its own session (PID = process group: a Ctrl-C at the terminal reaches only the run, which ends its
    children itself), stdin closed, output appended to `log`. `tied`: also sent SIGTERM when this process ends,
    even by SIGKILL (Linux; `infra.procs.die_with_parent`): for a child that must not outlive its run."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=procs.die_with_parent() if tied else None,
        )  # fmt: skip
    return Proc(pid=process.pid, create_time=procs.create_time(process.pid), log=str(log))


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is free, LISTEN is not
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ServerError(f"cannot listen on {host}:{port}: {exc}") from exc


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_until(ready: Callable[[], bool], proc: Proc, what: str, timeout: float) -> None:
    """Poll `ready` until it is true; ServerError with the tail of its log when `proc` exits first or after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if not is_running(proc):
            raise ServerError(f"{what} exited while starting; last lines of {proc.log}:\n{_log_tail(proc.log)}")
        time.sleep(0.5)
    raise ServerError(f"{what} not ready after {timeout:.0f} s; see {proc.log}")


def ensure_pool(api_url: str, pool: str) -> bool:
    """Create the process work pool (its job env carrying JOB_ENV) unless it exists; True when created."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415 - keeps `status`/`stop` light
    from prefect.client.schemas.actions import WorkPoolCreate  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415
    from prefect.workers.process import ProcessWorker  # noqa: PLC0415

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
            return False
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            template["variables"]["properties"]["env"]["default"] = dict(JOB_ENV)
            client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
            return True


def worker_online(api_url: str, pool: str, name: str) -> bool:
    """The worker has registered with the pool (its first heartbeat reached the server)."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415 - keeps `status`/`stop` light
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return any(w.name == name for w in client.read_workers_for_work_pool(pool))


def start(
    host: str = "127.0.0.1",
    port: int = 4200,
    pool: str = "latentforge",
    home: Path | None = None,
    cwd: Path | None = None,
    timeout: float = 120.0,
    ui_api_url: str | None = None,
) -> ServerState:
    """Start server and worker detached, wait until the API answers and the worker is in the pool; record both.

    The UI (in a browser) calls `ui_api_url`, by default this server's own API URL (on a wildcard host that is
    127.0.0.1: through an ssh tunnel; pass the host's address for browsers elsewhere). Refuses when this
    home's recorded server still runs; a stale record (both PIDs gone) is removed first."""
    directory = state_dir(home)
    current = status(home)
    if current is not None and not current.stale:
        raise ServerError(f"already running (server pid {current.state.server.pid}); `latentforge server stop` first")
    if current is not None:
        logger.warning("removing a stale state file (pids %d, %d)", current.state.server.pid, current.state.worker.pid)
        remove_state(home)
    _check_port_free(host, port)
    directory.mkdir(parents=True, exist_ok=True)
    local = "127.0.0.1" if host in WILDCARD_HOSTS else host
    base = f"http://[{local}]:{port}" if ":" in local else f"http://{local}:{port}"
    api_url, cwd = f"{base}/api", Path(cwd or Path.cwd())
    env = server_env(home, ui_api_url or api_url)
    server = spawn(server_command(host, port), env, directory / "server.log", cwd)
    worker: Proc | None = None
    try:
        wait_until(lambda: healthy(api_url), server, f"prefect server at {api_url}", timeout)
        ensure_pool(api_url, pool)
        name = f"latentforge-{socket.gethostname()}-{port}"
        worker_env = {**JOB_ENV, **env, "PREFECT_API_URL": api_url}
        worker_args = [*_prefect(), "--no-prompt", "worker", "start", "--pool", pool, "--name", name]
        worker = spawn(worker_args, worker_env, directory / "worker.log", cwd)
        wait_until(lambda: worker_online(api_url, pool, name), worker, f"worker {name}", timeout)
    except BaseException:
        for proc in (worker, server):
            if proc is not None:
                stop_group(proc, 10.0)
        raise
    started = datetime.now(UTC).isoformat(timespec="seconds")
    state = ServerState(host, port, api_url, base, pool, str(home) if home else None, server, worker, started)
    write_state(directory, state)
    return state
