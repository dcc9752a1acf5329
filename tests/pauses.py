"""Waiting for a paused run, as the approval, alert, audit and UI tests do before they answer it."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable

from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.paused_runs import PendingRun, pending_runs


def wait_pending(
    api_url: str | None = None,
    *,
    build: subprocess.Popen | None = None,
    match: Callable[[PendingRun], bool] = lambda run: True,
    wait_s: float = 180,
) -> PendingRun:
    """The oldest paused run that `match`es, once its preview is saved (just after the pause), from the API at
    `api_url` (None: this process's own). AssertionError when `build` exits first (its output in the message; it
    is killed on a timeout) or after `wait_s`."""
    settings = temporary_settings({PREFECT_API_URL: api_url}) if api_url else contextlib.nullcontext()
    deadline = time.monotonic() + wait_s
    with settings:
        while time.monotonic() < deadline:
            if build is not None:
                assert build.poll() is None, build.communicate()
            found = [run for run in pending_runs() if run.preview and match(run)]
            if found:
                return found[0]
            time.sleep(0.5)
    if build is not None:
        build.kill()
        raise AssertionError(f"no paused run within {wait_s} s: {build.communicate()}")
    raise AssertionError(f"no paused run within {wait_s} s")
