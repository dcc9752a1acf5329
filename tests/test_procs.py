"""Processes by PID (`infra.procs`) and the reaper of embedded servers (`infra.ops.ephemeral`), on real processes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from infra import procs
from infra.ops import ephemeral

SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while procs.same_process(pid, None) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs.same_process(pid, None) is None


def test_a_process_is_its_pid_and_its_start_time_alive_and_not_a_zombie():
    child = subprocess.Popen(SLEEP)
    started = procs.create_time(child.pid)
    assert started is not None
    assert procs.same_process(child.pid, started).pid == child.pid
    assert procs.same_process(child.pid, None) is not None  # a record without a start time: the pid decides
    assert procs.same_process(child.pid, started + 5) is None  # the pid reused by another process
    child.kill()
    assert _gone(child.pid)  # a zombie (not waited for yet) is not the process
    assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    child.wait()
    assert procs.same_process(child.pid, started) is None and procs.create_time(child.pid) is None


def test_stop_asks_first_and_kills_only_what_ignores_the_asking():
    polite = subprocess.Popen(SLEEP)
    assert procs.stop(psutil.Process(polite.pid), timeout=10) is False
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    deaf += "time.sleep(300)"
    stubborn = subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline() == "ready\n"
    started = time.monotonic()
    assert procs.stop(psutil.Process(stubborn.pid), timeout=0.5) is True
    assert time.monotonic() - started < 5 and _gone(stubborn.pid)
    stubborn.stdout.close()


PARENT = """
import subprocess, sys, time
from infra import procs
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], preexec_fn=procs.die_with_parent())
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_a_child_tied_to_its_parent_ends_when_the_parent_is_killed():
    root = str(Path(__file__).resolve().parents[1])
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=root)
    child = int(parent.stdout.readline())
    assert procs.same_process(child, None) is not None
    parent.send_signal(signal.SIGKILL)  # no handler, no exit hook runs
    parent.wait()
    parent.stdout.close()
    assert _gone(child), "the tied child outlived its SIGKILLed parent"


def _record(home: Path, server: subprocess.Popen, owner_pid: int, owner_created: float) -> Path:
    record = ephemeral.ServerRecord(
        server_pid=server.pid, server_create_time=procs.create_time(server.pid), owner_pid=owner_pid,
        owner_create_time=owner_created, host=socket.gethostname(), port=None, started_at="2026-01-01T00:00:00+00:00",
    )  # fmt: skip
    path = ephemeral.records_dir(home) / f"{server.pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.__dict__))
    return path


def test_the_reaper_stops_only_recorded_servers_whose_run_is_gone(tmp_path):
    home = tmp_path / "home"
    owner = subprocess.Popen(SLEEP)  # a run, then killed: no hook ran
    owner_created = procs.create_time(owner.pid)
    owner.kill()
    owner.wait()
    orphan = subprocess.Popen([*SLEEP, "server", "start"], start_new_session=True)  # reads as `prefect server start`
    stranger = subprocess.Popen(SLEEP)  # a recorded pid now held by something else than a Prefect server
    mine = subprocess.Popen([*SLEEP, "server", "start"], start_new_session=True)  # this process's own
    try:
        _record(home, orphan, owner.pid, owner_created)
        _record(home, stranger, owner.pid, owner_created)
        ephemeral.record_server(mine.pid, 4321, home)
        (ephemeral.records_dir(home) / "999999.json").write_text("not json")
        reaped = ephemeral.reap_orphans(home, timeout=5)
        assert [r.server_pid for r in reaped] == [orphan.pid]
        assert _gone(orphan.pid) and stranger.poll() is None and mine.poll() is None
        left = {p.name: r and r.server_pid for p, r in ephemeral.read_records(home)}
        assert left == {f"{mine.pid}.json": mine.pid, "999999.json": None}  # an unreadable record is left to a person
        assert ephemeral.is_embedded("http://127.0.0.1:4321/api", home) is True  # this process's own server
        assert ephemeral.is_embedded("http://127.0.0.1:4200/api", home) is False  # another server: not ours
        assert [r.server_pid for r in ephemeral.stop_own(timeout=5, home=home)] == [mine.pid]
        assert _gone(mine.pid)
        assert [p.name for p, _ in ephemeral.read_records(home)] == ["999999.json"]
    finally:
        for child in (orphan, stranger, mine):
            child.kill()
            child.wait()
