"""The ephemeral Prefect server spawned at a command's start, before the run imports its flows.

A terminal build imports ~10 s of CPU (torch, diffusers, transformers, Prefect's engines) before its first flow
runs, and Prefect's ephemeral server then spends 8-20 s of CPU on its own imports and database set-up before it
answers. Spawned after the imports (Prefect's own way), the second waits behind the first. `spawn` starts the
server's process at once instead, with Prefect's own command line (``python -m uvicorn ...
prefect.server.api.server:create_app`` on 127.0.0.1, a free port in 8000-8999, the UI off), in a session of its
own, recorded like every tracked server (`infra.ops.ephemeral`), without importing Prefect: the two starts run
side by side. `take` hands the process to `infra.ops.ephemeral.start_tracked` (which waits for its answer and points
the process's Prefect clients at it) when Prefect's settings resolve as they did at the spawn (the same home, no API
URL, ephemeral mode on, the same ``PREFECT_*`` environment); otherwise it stops it and the usual start follows. A
process never taken over is stopped at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.ops import ephemeral

logger = logging.getLogger(__name__)

#: Prefect's ephemeral port range (`SubprocessASGIServer._port_range`).
PORTS = range(8000, 9000)
#: What Prefect sets in its server's environment (`SubprocessASGIServer._run_uvicorn_command`): the UI off.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class Early:
    """A server process spawned by `spawn`, with what its start assumed."""

    process: subprocess.Popen[bytes]
    home: Path
    environment: dict[str, str]  # the PREFECT_* variables at the spawn
    record: ephemeral.ServerRecord
    path: Path  # its record file


_early: Early | None = None
_lock = threading.Lock()


def env_home() -> Path:
    """The Prefect home as the environment gives it (Prefect's default ``~/.prefect`` otherwise)."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser().resolve()


def wanted() -> bool:
    """Whether this process points at the ephemeral API: no ``PREFECT_API_URL`` and ephemeral mode not switched off,
    in the environment, the active profile or the working directory's settings files. Where Prefect is loaded
    already (a test's or a notebook's process), its settings answer: they may hold an API URL set in-process."""
    if "prefect.settings" in sys.modules:
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED  # noqa: PLC0415

        return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())
    try:
        return not any(_says_no(values) for values in _settings(Path.cwd()))
    except (OSError, ValueError):
        return False  # a settings file that cannot be read: the start is left to Prefect, which says what is wrong


#: The settings that switch the ephemeral server off when false.
_EPHEMERAL = ("PREFECT_SERVER_EPHEMERAL_ENABLED", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE")


def _says_no(values: Mapping[str, object]) -> bool:
    """``PREFECT_*`` settings that name an API URL or switch the ephemeral server off."""
    if str(values.get("PREFECT_API_URL") or "").strip():
        return True
    return any(str(values.get(name, "")).strip().lower() in _FALSE for name in _EPHEMERAL)


def _settings(where: Path) -> Iterator[Mapping[str, object]]:
    """The ``PREFECT_*`` settings of each source Prefect reads, as names and values: the environment, the working
    directory's ``.env``, ``prefect.toml`` and ``pyproject.toml`` (``[tool.prefect]``), and the active profile
    (``PREFECT_PROFILE`` or the file's ``active``). Any of them saying no is enough: the start is then Prefect's."""
    yield os.environ
    if (where / ".env").is_file():
        yield _dotenv((where / ".env").read_text(errors="replace"))
    for name, table in (("prefect.toml", ()), ("pyproject.toml", ("tool", "prefect"))):
        if (where / name).is_file():
            data = _dig(tomllib.loads((where / name).read_text()), *table)
            yield {
                "PREFECT_API_URL": _dig(data, "api", "url"),
                "PREFECT_SERVER_EPHEMERAL_ENABLED": _dig(data, "server", "ephemeral", "enabled"),
            }
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or env_home() / "profiles.toml").expanduser()
    if profiles.exists():
        data = tomllib.loads(profiles.read_text())
        profile = _dig(data, "profiles", os.environ.get("PREFECT_PROFILE") or data.get("active") or "ephemeral") or {}
        if not isinstance(profile, dict):
            raise ValueError(f"{profiles}: the active profile is not a table")
        yield profile


def _dig(data: object, *keys: str) -> Any:
    """``data[k1][k2]...``; None where a level is missing or not a table."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _dotenv(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of a ``.env`` file (``export`` and quotes allowed; comments and blank lines skipped)."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.strip().removeprefix("export ").partition("=")
        if sep and not key.lstrip().startswith("#"):
            value = value.strip()
            quoted = value[:1] in ("'", '"')  # then up to its closing quote; else up to a comment
            values[key.strip()] = value[1:].partition(value[0])[0] if quoted else value.partition(" #")[0].strip()
    return values


def _prefect_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")}


def _free_port() -> int:
    """A port of Prefect's range that binds now (as `SubprocessASGIServer.find_available_port` picks one)."""
    for _ in range(50):
        port = random.choice(PORTS)
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 8000-8999 for the embedded Prefect API")


def command(port: int) -> list[str]:
    """Prefect 3.9's ephemeral server command (`SubprocessASGIServer._run_uvicorn_command`)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("prefect is not installed")
    app_dir = str(Path(spec.origin).parent.parent)  # prefect.__module_path__.parent
    return [
        sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory", ephemeral.SERVER_APP,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip


def spawn() -> Early | None:
    """Spawn the ephemeral server's process now (main thread, before the heavy imports); None when this
    environment does not use the ephemeral API or a server was spawned already. Orphans of killed runs in the same
    home are reaped first. Until the run's own signal handling is installed, SIGTERM ends the process through its
    exit handlers, so the spawned server is stopped with it."""
    global _early
    with _lock:
        if _early is not None or not wanted():
            return None
        home = env_home()
        ephemeral.reap_orphans(home)
        port = _free_port()
        process = subprocess.Popen(command(port), env={**os.environ, **SERVER_ENV}, start_new_session=True)
        record, path = ephemeral.record_server(process.pid, port, home)
        _early = Early(process, home, _prefect_environment(), record, path)
    atexit.register(_stop_untaken)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logger.debug("embedded Prefect API spawned early: pid %d, port %d", process.pid, port)
    return _early


def _exit_on_sigterm(signum: int, frame: object) -> None:
    del frame
    raise SystemExit(128 + signum)


def take(home: Path, api_url: str | None, ephemeral_enabled: bool) -> Early | None:
    """The spawned process for `start_tracked` when Prefect's resolved settings are the spawn's; otherwise it is
    stopped (its record removed) and None returned, as when nothing was spawned."""
    global _early
    with _lock:
        early, _early = _early, None
    if early is None:
        return None
    same = (
        not api_url
        and ephemeral_enabled
        and Path(home).expanduser().resolve() == early.home
        and _prefect_environment() == early.environment
        and early.process.poll() is None
    )
    if same:
        return early
    logger.info("the early-spawned Prefect API does not match this run's settings: stopped")
    discard(early, wait_s=1.0)
    return None


def discard(early: Early, wait_s: float = 5.0) -> None:
    """Stop a spawned server that is not used (SIGTERM, SIGKILL after `wait_s`) and remove its record."""
    with contextlib.suppress(OSError):
        early.process.terminate()
        try:
            early.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            early.process.kill()
            early.process.wait()
    early.path.unlink(missing_ok=True)


def _stop_untaken() -> None:
    """At exit: a spawned server nobody took over (the command failed before its flow) is stopped."""
    global _early
    with _lock:
        early, _early = _early, None
    if early is not None:
        discard(early, wait_s=1.0)  # no run used it: a refused command exits at once (each migration is atomic)
