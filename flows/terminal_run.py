"""Run a flow from a terminal on whatever API is configured (the embedded ephemeral one by default)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from prefect import Flow
from prefect.settings import PREFECT_RUNNER_HEARTBEAT_FREQUENCY, temporary_settings

from flows.build import build_cache
from infra.config import BuildConfig
from infra.errors import LatentforgeError, RunFailed
from infra.ops import ephemeral, preempt
from infra.ops.alerts import WEBHOOK_ENV

logger = logging.getLogger("flows.run")  # its name before the rename: the same log lines


def run_flow(flow: Flow, **parameters: Any) -> tuple[bool, Any]:
    """Run `flow` to its end: (True, result) or (False, the reason it failed).

    The runner heartbeat costs ~1 s per flow run and no environment variable turns it off, so it is
    switched off here for terminal runs (a server-side automation covers crashed runs instead). The API is
    ``PREFECT_API_URL`` when set, else the run's own embedded server, started before the flow and stopped after it
    (`infra.ops.ephemeral.embedded_api`). A webhook URL in the config moves to this process's environment: flow
    parameters are stored in Prefect's database in plain text, and the URL may hold a token.

    SIGTERM, Ctrl-C and SIGHUP stop the run cleanly within the config's ``grace_seconds`` (`infra.ops.preempt`):
    a preempted run raises Preempted here, whatever state the flow ended in.
    """
    config = next((v for v in parameters.values() if isinstance(v, BuildConfig)), None)
    grace = config.run.grace_seconds if config is not None else None
    with preempt.handling(grace or BuildConfig.settings()["grace_seconds"].default), ephemeral.embedded_api():
        preempt.finish()  # a stop asked for while the server started
        return _run(flow, parameters)


def _run(flow: Flow, parameters: dict[str, Any]) -> tuple[bool, Any]:
    """Run the flow with the webhook moved to the environment and the heartbeat off."""
    webhooks = [v.alerts.webhook for v in parameters.values() if isinstance(v, BuildConfig) and v.alerts]
    parameters = {name: _without_webhook(value) for name, value in parameters.items()}
    webhook = next((w for w in webhooks if w), None)
    with _env(WEBHOOK_ENV, webhook), temporary_settings({PREFECT_RUNNER_HEARTBEAT_FREQUENCY: None}):
        try:
            state = flow(**parameters, return_state=True)
        except BaseException:
            preempt.finish()  # a stop that broke the engine (its API gone): still the preempted exit
            raise
    preempt.finish()
    if state.is_completed():
        return True, state.result()
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001  (the flow's own error, reported to the user)
        detail = exc.detail.rstrip() if isinstance(exc, LatentforgeError) else ""
        return False, f"{type(exc).__name__}: {exc}" + (f"\n{detail}" if detail else "")
    return False, state.message or state.name


def _without_webhook(value: Any) -> Any:
    """A BuildConfig without its ``alerts.webhook`` (other values as they are)."""
    if not isinstance(value, BuildConfig) or value.alerts is None or not value.alerts.webhook:
        return value
    return value.model_copy(update={"alerts": value.alerts.model_copy(update={"webhook": None})})


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` in this process's environment for the block (nothing when value is None); the config's
    webhook wins over the environment's, as `infra.ops.alerts.destinations` has it."""
    if value is None:
        yield
        return
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def run_or_raise(flow: Flow, **parameters: Any) -> Any:
    """Run `flow` to its end and return its result; RunFailed with the reason when it fails (its first line the
    error, the rest its detail)."""
    ok, result = run_flow(flow, **parameters)
    if not ok:
        headline, _, detail = str(result).partition("\n")
        raise RunFailed(headline, detail=detail)
    return result


def run_build(config: BuildConfig) -> tuple[bool, Any]:
    """Run build-cache to its end: (True, result) or (False, the reason it failed)."""
    return run_flow(build_cache, config=config)
