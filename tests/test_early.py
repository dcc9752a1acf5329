"""The embedded Prefect API spawned at a command's start (`infra.ops.early`): before the run's heavy imports, taken
over by the run, stopped when nothing takes it, on another port when its own was taken."""

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

from infra.ops import ephemeral
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]

WANTED = """
import json, os, sys
from infra.ops import early
seen = {}
def ask(name, **env):
    for key in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_ENABLED", "PREFECT_PROFILE"):
        os.environ.pop(key, None)
    os.environ.update(env)
    seen[name] = early.wanted()
ask("plain")
ask("api url", PREFECT_API_URL="http://127.0.0.1:4200/api")
ask("ephemeral off", PREFECT_SERVER_EPHEMERAL_ENABLED="false")
ask("profile with a url", PREFECT_PROFILE="remote")
ask("profile without", PREFECT_PROFILE="local")
seen["prefect imported"] = any(m == "prefect" or m.startswith("prefect.") for m in sys.modules)
print(json.dumps(seen))
"""


def test_the_environment_and_the_active_profile_tell_whether_to_spawn_without_importing_prefect(tmp_path):
    env = cli_env(tmp_path / "home")
    profiles = 'active = "local"\n[profiles.local]\n[profiles.remote]\nPREFECT_API_URL = "http://10.0.0.1:4200/api"\n'
    (tmp_path / "home" / "profiles.toml").write_text(profiles)
    done = subprocess.run([sys.executable, "-c", WANTED], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "plain": True,
        "api url": False,
        "ephemeral off": False,
        "profile with a url": False,
        "profile without": True,
        "prefect imported": False,  # the spawn costs no Prefect import
    }


NOT_TAKEN = """
import json, os
from infra.ops import early, ephemeral
out = {}
first = early.spawn()
out["again"] = early.spawn() is None  # one per process
out["recorded"] = [r.server_pid for _, r in ephemeral.read_records()] == [first.process.pid]
out["api url"] = early.take(early.env_home(), "http://127.0.0.1:1/api", True) is None
out["first gone"] = first.process.poll() is not None and not first.path.exists()
matching = early.spawn()
out["matching taken"] = early.take(early.env_home(), None, True) is matching and matching.process.poll() is None
early.discard(matching)
second = early.spawn()
os.environ["PREFECT_LOGGING_LEVEL"] = "DEBUG"  # the run's settings are no longer the spawn's
out["changed env"] = early.take(early.env_home(), None, True) is None
out["second gone"] = second.process.poll() is not None and not second.path.exists()
third = early.spawn()
out["third"] = third.process.pid
print(json.dumps(out))
"""  # the third is never taken: the exit handler stops it


def test_a_spawned_server_that_does_not_match_the_runs_settings_or_is_never_taken_is_stopped(tmp_path):
    env = cli_env(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-c", NOT_TAKEN], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    third = out.pop("third")
    expected = ("again", "recorded", "api url", "first gone", "matching taken", "changed env", "second gone")
    assert out == dict.fromkeys(expected, True)
    assert not _server_alive(third), "the spawned server nobody took outlived its process"
    assert ephemeral.read_records(tmp_path / "home") == []


BUILD = """
import importlib.abc, json, sys
import psutil
from infra.ops import early, ephemeral
report, taken_port = sys.argv[1], int(sys.argv[2])
seen = {}

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "flows.build") and name not in seen:
            children = [c for c in psutil.Process().children() if ephemeral.SERVER_APP in " ".join(c.cmdline())]
            seen[name] = [c.pid for c in children]
        return None

sys.meta_path.insert(0, Watch())
ports = [taken_port]
free = early._free_port
early._free_port = lambda: ports.pop() if ports else free()  # the first port is taken: uvicorn exits 3
from flows import cli
sys.argv = ["latentforge", "build", *sys.argv[3:]]
try:
    cli.main()
except SystemExit as exc:
    seen["exit"] = exc.code
seen["records"] = [(r.server_pid, r.port) for _, r in ephemeral.read_records()]
with open(report, "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.soak  # ~35 s: two real server starts (uvicorn finds its port taken only after its start-up)
def test_a_build_spawns_its_server_before_its_imports_and_moves_it_off_a_taken_port(tmp_path, clips, tiny_model):
    from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: PLC0415

    src = tmp_path / "src"
    src.mkdir()
    files = {"ground_truth.mp4": clips["carphone"], "prompt.txt": b"a car"}
    sample = DemoSample(generator="G-1_x_data-generator", task="x", index=0, files=files)
    write_vbvr_tar(src / "part-00000.tar", [sample])
    args = ["--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(tmp_path / "out"), "--frames", "5"]
    args += ["--height", "32", "--width", "32", "--device", "cpu", "--dry-run"]  # the whole start, a plan-only flow
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        report = tmp_path / "seen.json"
        env = cli_env(tmp_path / "home")
        done = subprocess.run(
            [sys.executable, "-c", BUILD, str(report), str(port), *args],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(report.read_text())
    assert seen.get("exit") in (None, 0), done.stderr[-3000:]
    assert len(seen["torch"]) == 1, "no server process existed when the build began importing torch"
    assert seen["flows.build"] == seen["torch"]
    ((pid, moved_to),) = seen["records"]  # the server the run used, recorded until its exit
    assert moved_to != port and pid != seen["torch"][0], "the server was not moved off the taken port"
    assert json.loads(done.stdout[done.stdout.index("{") :])["sample"].endswith("_00000000")  # from the flow
    assert not _server_alive(pid) and not _server_alive(seen["torch"][0])
    assert ephemeral.read_records(tmp_path / "home") == []


def test_a_refused_build_stops_the_server_it_spawned(tmp_path, tiny_model):
    env = cli_env(tmp_path / "home")
    (tmp_path / "src").mkdir()
    args = ["--source", f"vbvr:{tmp_path / 'src'}", "--model", str(tiny_model), "--out", str(tmp_path / "o")]
    args += ["--frames", "4"]  # refused by the spec, before any flow: Wan needs 4k+1 frames
    code = (
        "import sys, json; from infra.ops import early; from flows import cli\n"
        "spawn = early.spawn\n"
        "def watched():\n"
        "    e = spawn(); print(json.dumps({'pid': e.process.pid}), flush=True); return e\n"
        "early.spawn = watched\n"
        "sys.argv = ['latentforge', 'build', *sys.argv[1:]]\ncli.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "frames=4 (needs frames" in done.stderr, done.stderr[-3000:]
    pid = json.loads(done.stdout.strip().splitlines()[0])["pid"]
    assert not _server_alive(pid), "the refused build's server outlived it"
    assert ephemeral.read_records(tmp_path / "home") == []


def _server_alive(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and ephemeral.SERVER_APP in " ".join(process.cmdline())
    except psutil.Error:
        return False


WATCHED = """
import importlib.abc, json, sys
import psutil
from infra.ops import ephemeral
report = sys.argv.pop(1)

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not sys.meta_path[0].seen:
            sys.meta_path[0].seen = True
            children = [c for c in psutil.Process().children() if ephemeral.SERVER_APP in " ".join(c.cmdline())]
            with open(report + ".tmp", "w") as f:
                json.dump([c.pid for c in children], f)
            import os; os.replace(report + ".tmp", report)
        return None

Watch.seen = False
sys.meta_path.insert(0, Watch())
from flows import cli
sys.argv = ["latentforge", *sys.argv[1:]]
cli.main()
"""


def test_the_server_is_spawned_before_the_imports_and_a_sigterm_then_still_stops_it(tmp_path, tiny_model):
    """The build's server process exists when the build begins importing torch (the first of its ~17 s of imports);
    a SIGTERM then, before the run's own signal handling exists (`infra.ops.preempt`), ends the command through its
    exit handlers: the server it spawned is stopped, not orphaned."""
    env = cli_env(tmp_path / "home")
    (tmp_path / "src").mkdir()
    report = tmp_path / "at-torch.json"
    args = ["build", "--source", f"vbvr:{tmp_path / 'src'}", "--model", str(tiny_model), "--out", str(tmp_path / "o")]
    with subprocess.Popen(
        [sys.executable, "-c", WATCHED, str(report), *args],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    ) as build:  # fmt: skip
        deadline = time.monotonic() + 60
        while not report.exists() and build.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        build.send_signal(signal.SIGTERM)  # while it imports torch and the flows
        _, stderr = build.communicate(timeout=60)
    assert report.exists(), stderr[-3000:]
    (server,) = json.loads(report.read_text())  # spawned before the first heavy import
    assert build.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert not _server_alive(server), "the spawned server outlived the signalled build"
    assert ephemeral.read_records(tmp_path / "home") == []
