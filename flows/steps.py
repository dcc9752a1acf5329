"""Which step a flow run is in, so that a failure alert can name it (hooks run after the flow function)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from prefect.runtime import flow_run

from infra.ops import preempt

_lock = threading.Lock()
_current: dict[str, str] = {}


def _run_key() -> str:
    return str(flow_run.get_id() or "local")


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Mark the current flow run as being in step `name`; a failure keeps the mark (the failed step)."""
    key = _run_key()
    with _lock:
        previous = _current.get(key)
        _current[key] = name
    yield
    with _lock:
        if previous is None:
            _current.pop(key, None)
        else:
            _current[key] = previous


def set_step(name: str) -> None:
    """Mark the step without a block (a linear flow moving on). A run asked to stop (SIGTERM, Ctrl-C) stops here,
    between steps: Preempted."""
    preempt.check()
    with _lock:
        _current[_run_key()] = name


def current_step(run_id: str) -> str | None:
    """The step the run was in (the failed one, after a failure); None when it never marked one."""
    with _lock:
        return _current.get(str(run_id))


def forget(run_id: str) -> None:
    with _lock:
        _current.pop(str(run_id), None)
