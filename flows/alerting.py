"""Flow hooks that send alerts: on failure, on crash, and when a run pauses for a person.

The config is read back from the run's own parameters (``config.alerts``), the step from `flows.steps`.
A saved Prefect notification block (Slack, custom webhook, ...) is loaded by ``TYPE/NAME``.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.blocks.core import Block
from prefect.blocks.notifications import NotificationBlock
from prefect.runtime import flow_run as current_run
from prefect.settings import get_current_settings
from pydantic import BaseModel, ValidationError

from flows.steps import current_step, forget
from infra.config import AlertConfig
from infra.ops.alerts import Alert, Destinations, Kind, destinations, post_webhook, run_url

logger = logging.getLogger(__name__)


def alert_config(parameters: dict[str, Any] | None) -> AlertConfig | None:
    """``alerts`` from a run's parameters: the build's ``config.alerts`` or a flow's own ``alerts``."""
    parameters = parameters or {}
    for holder in (parameters.get("config"), parameters):
        if isinstance(holder, BaseModel):
            holder = holder.model_dump()
        if isinstance(holder, dict) and holder.get("alerts"):
            try:
                return AlertConfig.model_validate(holder["alerts"])
            except ValidationError:
                logger.error("alerts settings of this run are invalid; using the environment only")
    return None


def deliver(alert: Alert, where: Destinations) -> list[str]:
    """Send to every destination; returns the ones that took it ("webhook", "block:NAME")."""
    delivered = []
    if where.webhook and post_webhook(where.webhook, alert):
        delivered.append("webhook")
    if where.block:
        try:
            block = Block.load(where.block)
            if not isinstance(block, NotificationBlock):
                raise TypeError(f"{where.block} is a {type(block).__name__}, not a notification block")
            block.notify(alert.body, alert.subject)
            delivered.append(f"block:{where.block}")
        except Exception as exc:  # noqa: BLE001 - an alert that cannot be sent must not change the run's outcome
            logger.error("alert block %s not delivered: %s: %s", where.block, type(exc).__name__, exc)
    return delivered


def _ui() -> str | None:
    return get_current_settings().ui_url  # derived from PREFECT_API_URL when PREFECT_UI_URL is unset


def _on_end(kind: Kind, flow: Any, run: Any, state: Any) -> None:
    where = destinations(alert_config(run.parameters))
    step = current_step(str(run.id))
    forget(str(run.id))
    if not where:
        return
    reason = state.message or state.name
    alert = Alert(kind, flow.name, run.name, str(run.id), step, reason, run_url(_ui(), str(run.id)))
    logger.info("alert %s → %s", alert.subject, deliver(alert, where) or "nowhere (delivery failed)")


def on_failure(flow: Any, run: Any, state: Any) -> None:
    """Flow hook: the run failed (a gate, an error, a pause that timed out)."""
    _on_end("failed", flow, run, state)


def on_crashed(flow: Any, run: Any, state: Any) -> None:
    """Flow hook: the run crashed (killed, out of memory, interrupted)."""
    _on_end("crashed", flow, run, state)


def alert_paused(gate: str, summary: str) -> None:
    """Tell people that this run waits for an answer (called just before it pauses)."""
    where = destinations(alert_config(current_run.parameters))
    if not where:
        return
    run_id = str(current_run.get_id())
    reason = f"{gate}: {summary} — answer in the UI or `latentforge approve {run_id} CHOICE`"
    flow, name = current_run.flow_name or "?", current_run.name or "?"
    alert = Alert("paused", flow, name, run_id, gate, reason, run_url(_ui(), run_id))
    deliver(alert, where)
