"""`latentforge server start|status|stop`: a detached server and worker, recorded by PID, stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings
from typer.testing import CliRunner

from flows.cli import app
from infra import procs
from infra.ops import server

LF = [sys.executable, "-m", "flows.cli"]  # this checkout's code (the console script may be another's)
POOL = "lf-test-pool"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _listening_addresses(pid: int, port: int) -> set[str]:
    """The addresses the process tree of `pid` listens on at `port`."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    return {
        c.laddr.ip
        for p in tree
        for c in p.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def _lf(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*LF, "server", *args], env=env, capture_output=True, text=True, timeout=180)


def _pool_type(api_url: str, name: str) -> tuple[str, dict]:
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        pool = client.read_work_pool(name)
    return pool.type, pool.base_job_template["variables"]["properties"]["env"]["default"]


# ~45 s of a real server and worker start-up: in make soak. `server start --port` and `server stop` run in make test
# (tests/test_ui.py's fixture), `server status` in the unit tests below.
@pytest.mark.soak
def test_start_status_stop(tmp_path, prefect_server):
    home, port = tmp_path / "home", _free_port()
    env = {**prefect_server, "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL")
    env.pop("PREFECT_HOME")
    started = _lf("start", "--port", str(port), "--home", str(home), "--pool", POOL, env=env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        api_url = f"http://127.0.0.1:{port}/api"
        assert f"export PREFECT_API_URL={api_url}" in started.stdout and f"http://127.0.0.1:{port}" in started.stdout
        state = json.loads((home / "latentforge-server" / server.STATE_FILE).read_text())
        assert (state["port"], state["api_url"], state["pool"]) == (port, api_url, POOL)
        procs = [server.Proc(**state[name]) for name in ("server", "worker")]
        assert all(server.is_running(proc) for proc in procs)
        with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
            assert response.status == 200
        assert _listening_addresses(procs[0].pid, port) == {"127.0.0.1"}  # loopback unless --host says otherwise
        assert _pool_type(api_url, POOL) == ("process", server.JOB_ENV)

        status = _lf("status", "--home", str(home), env=env)
        assert status.returncode == 0 and status.stdout.count("running") == 2 and "healthy" in status.stdout
        again = _lf("start", "--port", str(_free_port()), "--home", str(home), env=env)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        stopped = _lf("stop", "--home", str(home), "--timeout", "10", env=env)
    assert stopped.returncode == 0 and "stopped worker" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not any(server.is_running(proc) for proc in procs)
    assert not (home / "latentforge-server" / server.STATE_FILE).exists()
    assert server.healthy(prefect_server["PREFECT_API_URL"])  # the other server on this host is untouched
    status = _lf("status", "--home", str(home), env=env)
    assert status.returncode == 1 and "stopped" in status.stdout


def test_start_refuses_a_port_in_use(tmp_path, prefect_server):
    busy = prefect_server["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0]
    result = CliRunner().invoke(app, ["server", "start", "--port", busy, "--home", str(tmp_path)])
    assert result.exit_code == 1 and "cannot listen" in result.output
    assert not (tmp_path / "latentforge-server" / server.STATE_FILE).exists()


def test_a_stale_state_file_is_reported_and_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID is gone (and reaped)
    gone = server.Proc(pid=dead.pid, create_time=None, log=str(tmp_path / "x.log"))
    state = server.ServerState(
        "127.0.0.1", _free_port(), "http://127.0.0.1:1/api", "http://127.0.0.1:1", "p", str(tmp_path), gone, gone, "t"
    )
    directory = server.state_dir(tmp_path)
    directory.mkdir(parents=True)
    path = server.write_state(directory, state)
    result = CliRunner().invoke(app, ["server", "status", "--home", str(tmp_path)])
    assert result.exit_code == 1 and "stale" in result.output and result.output.count("stopped") == 2
    assert not path.exists()


def test_a_reused_pid_is_neither_running_nor_signalled():
    """A PID recorded with another start time (reused since, e.g. after a reboot) is not ours: stop leaves it."""
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        recorded = server.Proc(pid=other.pid, create_time=1.0, log="")
        assert not server.is_running(recorded)
        assert not server.stop_group(recorded, timeout=1) and other.poll() is None
        ours = server.Proc(pid=other.pid, create_time=procs.create_time(other.pid), log="")
        assert server.is_running(ours)
        assert not server.stop_group(ours, timeout=5)  # True only when SIGKILL was needed
        assert other.wait(timeout=5) == -signal.SIGTERM
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)


def test_an_unreadable_state_file_is_an_error_not_a_crash(tmp_path):
    directory = server.state_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / server.STATE_FILE).write_text("{not json")
    for command in ("status", "stop", "start"):
        result = CliRunner().invoke(app, ["server", command, "--home", str(tmp_path)])
        assert result.exit_code == 1 and "unreadable" in result.output, (command, result.output)
