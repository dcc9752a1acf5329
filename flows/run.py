"""Run a flow from a terminal on whatever API is configured (the embedded ephemeral one by default)."""

from __future__ import annotations

import logging
from typing import Any

from prefect import Flow
from prefect.settings import PREFECT_RUNNER_HEARTBEAT_FREQUENCY, temporary_settings

from flows.build import build_cache
from infra.config import BuildConfig
from infra.errors import RunFailed

logger = logging.getLogger(__name__)


def run_flow(flow: Flow, **parameters: Any) -> tuple[bool, Any]:
    """Run `flow` to its end: (True, result) or (False, the reason it failed).

    The runner heartbeat costs ~1 s per flow run and no environment variable turns it off, so it is
    switched off here for terminal runs (a server-side automation covers crashed runs instead).
    """
    with temporary_settings({PREFECT_RUNNER_HEARTBEAT_FREQUENCY: None}):
        state = flow(**parameters, return_state=True)
    if state.is_completed():
        return True, state.result()
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001  (the flow's own error, reported to the user)
        return False, f"{type(exc).__name__}: {exc}"
    return False, state.message or state.name


def run_or_raise(flow: Flow, **parameters: Any) -> Any:
    """Run `flow` to its end and return its result; RunFailed with the reason when it fails."""
    ok, result = run_flow(flow, **parameters)
    if not ok:
        raise RunFailed(str(result))
    return result


def run_build(config: BuildConfig) -> tuple[bool, Any]:
    """Run build-cache to its end: (True, result) or (False, the reason it failed)."""
    return run_flow(build_cache, config=config)
