"""bench/gpu/wheels.py: the wheelhouse the GPU host lacks for a full build, packed to fit one 64 MiB transfer.

* the lock is the project's requirement tree less the host's packages (a new dependency shows here);
* a build imports nothing the wheelhouse drops (its CLI and its Prefect server traced with ``-X importtime``);
* in ``make soak``, on Python 3.12 with the registry (skipped where either is missing): the wheelhouse fits,
  installs with ``pip install --no-index --no-deps --target``, and with stand-ins of the host's own packages (the
  host's pinned versions where its notes give them) every requirement of every wheel is met, the project's non-torch
  imports load, and the Prefect server starts ``--no-ui`` from it (no UI files, no apprise) and runs a flow.

What the 3.12 test cannot do here: ``latentforge build --help`` imports torch (``infra.devices``,
``infra.cache.cachedir``), and no cp312 torch that imports without CUDA reaches this machine (the registry's Linux
torch is the CUDA build, whose 13 nvidia-* pins it does not hold), so the host's first command runs it there
(bench/gpu/run.sh).
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.gpu import wheels
from infra.demo.testmedia import media_cache_dir
from infra.ops import server
from tests.conftest import make_shards, sample
from tests.procs import free_port, stop_group, wait_answers

ROOT = Path(__file__).resolve().parents[1]
TRANSFER_MIB = 64.0
CLIPS_MIB = 2.6  # the four test-media clips bench/gpu/run.sh carries
#: Modules whose import means the trimmed parts were needed after all (top-level names of the dropped packages).
DROPPED_MODULES = {"apprise"}


def python312() -> str | None:
    """A Python 3.12 that runs (LATENTFORGE_PYTHON312, python3.12 on PATH, or pyenv's)."""
    candidates = [os.environ.get("LATENTFORGE_PYTHON312"), "python3.12"]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                  text=True, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == "(3, 12)":
            return candidate
    return None


def test_the_lock_is_the_project_tree_less_the_host_packages() -> None:
    locked = wheels.read_names(wheels.LOCK)
    walked = wheels.missing_tree(wheels.project_requirements(), wheels.read_names(wheels.HOST_LIST))
    assert set(locked) == set(walked) | set(wheels.EXTRA_PINS), "stale: python bench/gpu/wheels.py --lock"
    assert {"prefect", "diffusers", "av", "pydantic", "sqlalchemy", "h2"} <= set(locked)  # h2: httpx[http2]'s
    assert not set(locked) & set(wheels.read_names(wheels.HOST_LIST))
    assert all(locked.values())  # every one pinned


def imported(log: str) -> set[str]:
    """Module names an ``-X importtime`` log says were imported."""
    return {line.rsplit("|", 1)[1].strip() for line in log.splitlines() if line.startswith("import time:")} - {
        "package"
    }


@pytest.mark.soak  # tens of seconds of real builds: make soak (the suite stays under 15 minutes)
def test_a_build_imports_nothing_the_wheelhouse_drops(tmp_path, tiny_model, clips) -> None:
    src = make_shards(tmp_path / "src", {"s0": [sample(0, 0, clips["carphone"], b"a ball rolls")]})
    port, home = free_port(), tmp_path / "home"
    url = f"http://127.0.0.1:{port}/api"
    env = {**server.server_env(home, url), "PYTHONPROFILEIMPORTTIME": "1"}
    with (tmp_path / "server.log").open("wb") as log:
        proc = subprocess.Popen(server.server_command("127.0.0.1", port, ui=False), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_answers(f"{url}/health", proc, "prefect server", timeout=120)
            build = [sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(tiny_model)]
            build += ["--out", str(tmp_path / "out"), "--frames", "5", "--height", "32", "--width", "32"]
            build += ["--device", "cpu", "--dtype", "fp32", "--decode-samples", "1", "--on-conflict", "abort"]
            done = subprocess.run(build, env={**env, "PREFECT_API_URL": url}, capture_output=True, text=True,
                                  timeout=300, cwd=ROOT)  # fmt: skip
        finally:
            stop_group(proc)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    cli, served = imported(done.stderr), imported((tmp_path / "server.log").read_text(errors="replace"))
    assert {"av", "diffusers", "prefect"} <= {name.split(".")[0] for name in cli}  # the trace sees the build
    assert {"prefect.server.api.server", "asyncpg"} <= served  # ... and the server (asyncpg: kept, it is imported)
    for process in (cli, served):
        assert (
            not {name.split(".")[0] for name in process} & DROPPED_MODULES
        )  # prefect.blocks.notifications imports it in its methods


def host_standins(met: dict[str, str], host: dict[str, str | None]) -> dict[str, str]:
    """The host's packages the build meets and what they need in turn (torch's tree left out: no cp312 CPU torch
    here), each at the host's version where known, else this environment's."""
    wanted, stack = {}, [name for name in met if name != "torch"]
    while stack:
        name = stack.pop()
        if name in wanted or name not in host or name == "torch":
            continue
        wanted[name] = host[name] or md.version(name)
        for text in md.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(wheels.HOST_MARKERS | {"extra": ""}):
                stack.append(canonicalize_name(req.name))
    return wanted


def pip312(python: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})  # fmt: skip


CHECK = """
import importlib.metadata as md, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
site, host, dropped = sys.argv[1], sys.argv[2], set(sys.argv[3].split(","))
env = {"extra": ""}
have = {cn(d.metadata["Name"]): d.version for d in md.distributions(path=[site, host])}
bad = []
for dist in md.distributions(path=[site]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = cn(req.name)
        if name == "torch" or name in dropped:
            continue  # the host's 2.11; what the wheelhouse drops (never imported: the test above)
        if name not in have:
            bad.append(f"{dist.metadata['Name']} needs {req}: missing")
        elif req.specifier and not req.specifier.contains(have[name], prereleases=True):
            bad.append(f"{dist.metadata['Name']} needs {req}: {have[name]} there")
print("\\n".join(bad) or "ok")
"""
IMPORTS = (
    "import prefect, prefect.server.api.server, diffusers, av, pydantic, sqlalchemy, fastapi, uvicorn, yaml, typer"
)
FLOW = """
from prefect import flow
@flow
def ping(x: int) -> int:
    return x + 1
assert ping(41) == 42
print("flow-ok")
"""


@pytest.mark.soak  # minutes (the registry's ~75 MiB twice, a --target install, a server start): make soak
def test_the_wheelhouse_fits_one_transfer_and_installs_for_the_host(tmp_path) -> None:
    python = python312()
    if python is None:
        pytest.skip("no Python 3.12 here (the host's interpreter; set LATENTFORGE_PYTHON312)")
    probe = pip312(python, "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp_path / "probe"),
                   "packaging==24.2", timeout=120)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"the package registry cannot be reached: {probe.stderr.strip().splitlines()[-1:]}")
    line = wheels.build(tmp_path / "whl")
    assert line.startswith("wheels: ") and "dropped: apprise" in line
    size = sum(p.stat().st_size for p in (tmp_path / "whl").glob("*.whl")) / 2**20
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=ROOT, check=True).stdout.split(b"\0")
    tree = sum((ROOT / name.decode()).stat().st_size for name in tracked if name and (ROOT / name.decode()).is_file())
    assert size <= wheels.MAX_MIB and size + tree / 2**20 + CLIPS_MIB < TRANSFER_MIB, (size, tree)

    site, host = tmp_path / "site", tmp_path / "host"
    done = pip312(python, "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site),
                  *map(str, sorted((tmp_path / "whl").glob("*.whl"))))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (site / "prefect/server/ui").exists() and not (site / "apprise").exists()
    standins = host_standins(wheels.walk(wheels.project_requirements(), wheels.read_names(wheels.HOST_LIST))[1],
                             wheels.read_names(wheels.HOST_LIST))  # fmt: skip
    cache = media_cache_dir() / "gpu-host"
    pins = [f"{name}=={version}" for name, version in sorted(standins.items())]
    platforms = [arg for p in (*wheels.PLATFORMS, "manylinux2014_x86_64") for arg in ("--platform", p)]
    done = pip312(python, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                  "--implementation", "cp", *platforms, "-d", str(cache), *pins)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = pip312(python, "install", "-q", "--no-index", "--no-deps", "--no-compile", "--find-links", str(cache),
                  "--target", str(host), *pins)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PREFECT_"))}
    env |= {"PYTHONPATH": f"{site}{os.pathsep}{host}", "PREFECT_HOME": str(tmp_path / "prefect")}
    check = subprocess.run(
        [python, "-c", CHECK, str(site), str(host), ",".join(wheels.DROP)], capture_output=True, text=True, env=env
    )
    assert check.stdout.strip() == "ok", check.stdout + check.stderr[-2000:]
    done = subprocess.run([python, "-c", IMPORTS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    command = [python, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    with (tmp_path / "server.log").open("wb") as log:
        proc = subprocess.Popen(command, env=env | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_answers(f"{url}/health", proc, "prefect server (3.12, from the wheelhouse)", timeout=180)
            flow = subprocess.run([python, "-c", FLOW], capture_output=True, text=True, timeout=300,
                                  env=env | {"PREFECT_API_URL": url})  # fmt: skip
        finally:
            stop_group(proc)
    assert "flow-ok" in flow.stdout, flow.stdout[-2000:] + flow.stderr[-3000:]
