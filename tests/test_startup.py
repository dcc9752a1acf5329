"""Start-up: the run's first imports overlap the ephemeral Prefect server's start, without touching its API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from infra.ops import ephemeral, warmup
from tests.conftest import config
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_main_threads_spawn_gets_its_own_session_and_starts_the_work():
    started: list[str] = []
    sessions: dict[str, int] = {}

    def spawn(name: str) -> None:
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"]) as child:
            sessions[name] = os.getsid(child.pid)
            child.wait()

    with ephemeral._own_session(on_spawn=lambda: started.append(threading.current_thread().name)):
        other = threading.Thread(target=spawn, args=("other",), name="other")
        other.start()
        other.join()
        spawn("main")
    assert sessions["other"] == os.getsid(0)  # a spawn of another thread is left as it is
    assert sessions["main"] != os.getsid(0)  # the server's: a session of its own (Ctrl-C reaches only us)
    assert started == ["MainThread"]


def test_modules_for_a_build_are_the_engines_and_the_familys(tmp_path, tiny_model):
    names = warmup.modules_for(config(tmp_path / "src", tiny_model, tmp_path / "out"))
    assert names[: len(warmup.ENGINE_MODULES)] == list(warmup.ENGINE_MODULES)
    assert "diffusers:AutoencoderKLWan" in names
    assert warmup.modules_for(config(tmp_path, tmp_path / "no-model", tmp_path / "out")) == list(warmup.ENGINE_MODULES)
    warmup.importer(["json:dumps", "no_such_module_here", "json:no_such_attribute"])()  # failures only logged


CHILD = """
import json, sys, threading, time
import psutil
from infra.ops import ephemeral
seen = {}
def work():
    children = [" ".join(c.cmdline()) for c in psutil.Process().children()]
    seen.update(thread=threading.current_thread().name, spawned=any(ephemeral.SERVER_APP in c for c in children))
    time.sleep(1.0)
    seen["finished"] = time.monotonic()
record = ephemeral.start_tracked(while_starting=work)
seen["returned"] = time.monotonic()
print(json.dumps({**seen, "pid": record.server_pid}))
"""


@pytest.mark.soak  # ~20 s: a real ephemeral start; the ordering itself is tested above without one
def test_the_start_up_work_runs_beside_the_servers_start_and_ends_before_it_returns(tmp_path):
    """In a fresh process and Prefect home (this session's server already runs, so nothing is started here)."""
    env = cli_env(tmp_path / "home")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["thread"] == "lf-start-up" and seen["spawned"]  # after the server's process exists
    assert seen["finished"] <= seen["returned"]  # joined: nothing runs beside the flow
    assert ephemeral.read_records(tmp_path / "home") == []  # stopped and its record removed at exit
