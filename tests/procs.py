"""Server processes the tests start (Prefect, moto): a free port, wait until it answers, stop it by its PID."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

#: The Prefect database file in a Prefect home (sqlite, the default).
PREFECT_DB = "prefect.db"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_answers(url: str, proc: subprocess.Popen, what: str, timeout: float) -> None:
    """Poll `url` until it answers 200; RuntimeError when `proc` exits first or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} at {url} did not answer within {timeout} s")


def stop_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_seed: list[Path] = []


def seed_migrated_database(database: Path) -> None:
    """Copy the migrated (and still empty) database of this process's test harness as the one `prefect_home`
    hands out, so that no test pays for the migrations again (call it once, just after the harness starts)."""
    target = Path(tempfile.mkdtemp(prefix="lf-prefect-db-")) / PREFECT_DB
    atexit.register(shutil.rmtree, target.parent, ignore_errors=True)
    with contextlib.closing(sqlite3.connect(database)) as src, contextlib.closing(sqlite3.connect(target)) as dst:
        src.backup(dst)  # consistent while the harness's server has it open
    _seed[:] = [target]


@functools.cache
def _migrated_database() -> Path:
    """The seeded database, else one made here (`prefect server database upgrade`, ~20 s)."""
    if _seed:
        return _seed[0]
    template = Path(tempfile.mkdtemp(prefix="lf-prefect-home-"))
    atexit.register(shutil.rmtree, template, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(template), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    prefect = str(Path(sys.executable).with_name("prefect"))
    subprocess.run(
        [prefect, "server", "database", "upgrade", "-y"], env=env, check=True, capture_output=True, timeout=600
    )
    return template / PREFECT_DB


def prefect_home(home: Path) -> Path:
    """`home` (created if absent) holding a migrated Prefect database, unless it has a database already: a server
    or an ephemeral API started there answers ~10 s sooner than on a new home (no migrations to run)."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    if not (home / PREFECT_DB).exists():
        shutil.copy2(_migrated_database(), home / PREFECT_DB)
    return home


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a `python -m flows.cli` subprocess of this checkout: its own Prefect home (the embedded
    server on a migrated database, no server URL inherited), and `extra`. The start-up timeout is set to 1 s,
    shorter than any real start: these builds start only because latentforge waits at least `MIN_STARTUP_TIMEOUT`
    (the floor a loaded machine needs, which these tests therefore keep)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_KEY")}
    root = Path(__file__).resolve().parents[1]
    env.update(PYTHONPATH=str(root), PREFECT_HOME=str(prefect_home(home)))
    env.update(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    return env | extra
