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

from infra.ops import early, ephemeral
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]

WANTED = """
import json, os, sys
from infra.ops import early
seen, root = {}, os.getcwd()
def ask(name, cwd=".", **env):
    for key in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_ENABLED", "PREFECT_PROFILE"):
        os.environ.pop(key, None)
    os.environ.update(env)
    os.chdir(os.path.join(sys.argv[1], cwd))  # Prefect reads .env, prefect.toml and pyproject.toml here
    seen[name] = early.wanted()
    os.chdir(root)
ask("plain")
ask("api url", PREFECT_API_URL="http://127.0.0.1:4200/api")
ask("ephemeral off", PREFECT_SERVER_EPHEMERAL_ENABLED="false")
ask("profile with a url", PREFECT_PROFILE="remote")
ask("profile without", PREFECT_PROFILE="local")
ask("profile ephemeral off", PREFECT_PROFILE="offline")
for name in sorted(os.listdir(sys.argv[1])):  # one directory per settings-file case
    if name != "home":
        ask(name, cwd=name)
seen["prefect imported"] = any(m == "prefect" or m.startswith("prefect.") for m in sys.modules)
print(json.dumps(seen))
"""


def test_the_environment_and_the_active_profile_tell_whether_to_spawn_without_importing_prefect(tmp_path):
    env = cli_env(tmp_path / "home")
    profiles = 'active = "local"\n[profiles.local]\n[profiles.remote]\nPREFECT_API_URL = "http://10.0.0.1:4200/api"\n'
    profiles += '[profiles.offline]\nPREFECT_SERVER_EPHEMERAL_ENABLED = "false"\n'
    (tmp_path / "home" / "profiles.toml").write_text(profiles)
    files = {
        "dotenv url": (".env", "# remote\nexport PREFECT_API_URL='http://10.0.0.1:4200/api'\n"),
        "dotenv ephemeral off": (".env", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE = 'False'  # offline\n"),
        "dotenv other": (".env", "PREFECT_LOGGING_LEVEL=DEBUG\nPREFECT_API_URL=\n# PREFECT_API_URL=http://x\n"),
        "prefect.toml url": ("prefect.toml", '[api]\nurl = "http://10.0.0.1:4200/api"\n'),
        "prefect.toml ephemeral off": ("prefect.toml", "[server.ephemeral]\nenabled = false\n"),
        "prefect.toml other": ("prefect.toml", '[logging]\nlevel = "DEBUG"\n'),
        "pyproject url": ("pyproject.toml", '[tool.prefect.api]\nurl = "http://10.0.0.1:4200/api"\n'),
        "pyproject other": ("pyproject.toml", '[project]\nname = "x"\n[tool.ruff]\nline-length = 100\n'),
        "unreadable toml": ("prefect.toml", "[api\nurl = \n"),
    }
    for case, (name, text) in files.items():
        (tmp_path / case).mkdir()
        (tmp_path / case / name).write_text(text)
    done = subprocess.run(
        [sys.executable, "-c", WANTED, str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "plain": True,
        "api url": False,
        "ephemeral off": False,
        "profile with a url": False,
        "profile without": True,
        "profile ephemeral off": False,
        "dotenv url": False,
        "dotenv ephemeral off": False,
        "dotenv other": True,
        "prefect.toml url": False,
        "prefect.toml ephemeral off": False,
        "prefect.toml other": True,
        "pyproject url": False,
        "pyproject other": True,
        "unreadable toml": False,  # left to Prefect, which then says what is wrong with it
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


CHILD = """
import importlib.abc, json, os, sys
import psutil
from infra.ops import early, ephemeral
report, taken_port = sys.argv.pop(1), int(sys.argv.pop(1))

class AtTorch(importlib.abc.MetaPathFinder):  # the server processes when the first heavy import begins
    done = False
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not AtTorch.done:
            AtTorch.done = True
            me = psutil.Process()
            servers = [c.pid for c in me.children() if ephemeral.SERVER_APP in " ".join(c.cmdline())]
            with open(report + ".tmp", "w") as f:
                json.dump(servers, f)
            os.replace(report + ".tmp", report)
        return None

sys.meta_path.insert(0, AtTorch())
if taken_port:  # the early spawn's port is taken: uvicorn exits 3 after its start-up
    ports, free = [taken_port], early._free_port
    early._free_port = lambda: ports.pop() if ports else free()
from flows import cli
from infra.ops import quick_exit
finish = quick_exit.finish

def at_end(code):  # the servers recorded at the command's end (before its exit handlers: `main` ends the process
    # there), and whether Prefect's API app (its server module) was imported into the command's own process
    records = [(r.server_pid, r.port) for _, r in ephemeral.read_records()]
    with open(report + ".end", "w") as f:
        json.dump({"records": records, "server app imported": "prefect.server.api.server" in sys.modules}, f)
    finish(code)

quick_exit.finish = at_end
sys.argv = ["latentforge", *sys.argv[1:]]
cli.main()
"""


def _child(tmp_path: Path, args: list[str], taken_port: int = 0) -> list[str]:
    """`latentforge ARGS` in a child that reports the server processes at its first torch import (to
    ``tmp_path/at-torch.json``) and the recorded servers at its end (``.end``)."""
    return [sys.executable, "-c", CHILD, str(tmp_path / "at-torch.json"), str(taken_port), *args]


def _reported(tmp_path: Path, suffix: str = "") -> list:
    return json.loads((tmp_path / f"at-torch.json{suffix}").read_text())


@pytest.mark.soak  # ~35 s: two real server starts (uvicorn finds its port taken only after its start-up)
def test_a_build_spawns_its_server_before_its_imports_and_moves_it_off_a_taken_port(tmp_path, clips, tiny_model):
    src = _one_sample_source(tmp_path, clips)
    args = ["build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(tmp_path / "out")]
    args += ["--frames", "5", "--height", "32", "--width", "32", "--device", "cpu", "--dry-run"]  # a plan-only flow
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            _child(tmp_path, args, port), env=cli_env(tmp_path / "home"), cwd=ROOT, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (first,) = _reported(tmp_path)  # spawned before the first heavy import
    ((pid, moved_to),) = _reported(tmp_path, ".end")["records"]  # the server the run used, recorded until its exit
    assert moved_to != port and pid != first, "the server was not moved off the taken port"
    assert json.loads(done.stdout[done.stdout.index("{") :])["sample"].endswith("_00000000")  # from the flow
    assert not _server_alive(pid) and not _server_alive(first)
    assert ephemeral.read_records(tmp_path / "home") == []


def _one_sample_source(root: Path, clips: dict[str, bytes]) -> Path:
    from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: PLC0415

    src = root / "src"
    src.mkdir()
    files = {"ground_truth.mp4": clips["carphone"], "prompt.txt": b"a car"}
    sample = DemoSample(generator="G-1_x_data-generator", task="x", index=0, files=files)
    write_vbvr_tar(src / "part-00000.tar", [sample])
    return src


@pytest.mark.soak  # ~19 s (a whole build process); in make test, tests/test_preempt.py checks the same server
def test_a_build_runs_on_the_server_it_spawned_without_importing_prefects_api_app(tmp_path, clips, tiny_model):
    """The taken-over server is the run's API for every Prefect client of the process, reached as a client reaches
    a running server: Prefect's server module (the whole API app, ~3 s of the run's CPU) is never imported into
    the run's process, and no link to a UI is printed (the embedded server has none)."""
    src = _one_sample_source(tmp_path, clips)
    args = ["build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(tmp_path / "out")]
    args += ["--frames", "5", "--height", "32", "--width", "32", "--device", "cpu", "--dry-run"]  # a plan-only flow
    done = subprocess.run(
        _child(tmp_path, args), env=cli_env(tmp_path / "home"), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Beginning flow run" in done.stderr, done.stderr[-3000:]  # the flow ran, on an API
    (spawned,) = _reported(tmp_path)
    end = _reported(tmp_path, ".end")
    assert [pid for pid, _ in end["records"]] == [spawned], "the run recorded another server than its spawn"
    assert end["server app imported"] is False
    assert "View at" not in done.stderr and "Starting temporary server" not in done.stderr
    assert not _server_alive(spawned)
    assert ephemeral.read_records(tmp_path / "home") == []


def test_a_refused_build_stops_the_server_it_spawned(tmp_path, tiny_model):
    (tmp_path / "src").mkdir()
    args = ["build", "--source", f"vbvr:{tmp_path / 'src'}", "--model", str(tiny_model), "--out", str(tmp_path / "o")]
    args += ["--frames", "4"]  # refused by the spec, before any flow: Wan needs 4k+1 frames
    done = subprocess.run(
        _child(tmp_path, args), env=cli_env(tmp_path / "home"), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "frames=4 (needs frames" in done.stderr, done.stderr[-3000:]
    (server,) = _reported(tmp_path)
    assert [pid for pid, _ in _reported(tmp_path, ".end")["records"]] == [server]  # recorded while it ran
    assert not _server_alive(server), "the refused build's server outlived it"
    assert ephemeral.read_records(tmp_path / "home") == []


def test_the_server_is_spawned_before_the_imports_and_a_sigterm_then_still_stops_it(tmp_path, tiny_model):
    """The build's server process exists when the build begins importing torch (the first of its ~17 s of imports);
    a SIGTERM then, before the run's own signal handling exists (`infra.ops.preempt`), ends the command through its
    exit handlers: the server it spawned is stopped, not orphaned."""
    (tmp_path / "src").mkdir()
    args = ["build", "--source", f"vbvr:{tmp_path / 'src'}", "--model", str(tiny_model), "--out", str(tmp_path / "o")]
    report = tmp_path / "at-torch.json"
    with subprocess.Popen(
        _child(tmp_path, args), env=cli_env(tmp_path / "home"), cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    ) as build:  # fmt: skip
        deadline = time.monotonic() + 60
        while not report.exists() and build.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        build.send_signal(signal.SIGTERM)  # while it imports torch and the flows
        _, stderr = build.communicate(timeout=60)
    assert report.exists(), stderr[-3000:]
    (server,) = _reported(tmp_path)  # spawned before the first heavy import
    assert build.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert not _server_alive(server), "the spawned server outlived the signalled build"
    assert ephemeral.read_records(tmp_path / "home") == []


def _server_alive(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and ephemeral.SERVER_APP in " ".join(process.cmdline())
    except psutil.Error:
        return False


def test_in_a_process_with_prefect_loaded_its_settings_decide(monkeypatch):
    """This test session's API URL is set in-process (Prefect's test harness), not in the environment: an in-process
    CLI command here spawns nothing."""
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert PREFECT_API_URL.value()
    assert early.wanted() is False
    assert early.spawn() is None
