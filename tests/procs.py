"""Server processes the tests start (Prefect, moto): a free port, wait until it answers, stop it by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


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


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a `python -m flows.cli` subprocess of this checkout: its own Prefect home (the embedded
    API, no server URL inherited), and `extra`. Prefect's own ephemeral start-up timeout is set to 1 s, shorter than
    any real start: these builds start only because latentforge waits at least `MIN_STARTUP_TIMEOUT` (the
    floor a loaded machine needs, which these tests therefore keep)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_KEY")}
    root = Path(__file__).resolve().parents[1]
    env.update(PYTHONPATH=str(root), PREFECT_HOME=str(home), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    return env | extra
