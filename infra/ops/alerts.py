"""Alerts: a short, structured message about a run that failed, crashed or waits for a person, and its
delivery to a plain webhook (JSON POST). Delivery never raises: an alert that cannot be sent is logged,
and the run's own outcome stands.

Where alerts go: ``alerts.webhook`` in the config, else ``LATENTFORGE_ALERT_WEBHOOK``; ``alerts.block`` (a
saved Prefect notification block, ``TYPE/NAME``), else ``LATENTFORGE_ALERT_BLOCK``. A webhook URL that holds
a secret (Slack's do) belongs in the environment or a block, not in a config file.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any, Literal

from infra.config import AlertConfig

logger = logging.getLogger(__name__)

WEBHOOK_ENV = "LATENTFORGE_ALERT_WEBHOOK"
BLOCK_ENV = "LATENTFORGE_ALERT_BLOCK"
TIMEOUT_S = 10

Kind = Literal["failed", "crashed", "paused"]


@dataclass(frozen=True)
class Alert:
    """What happened to which run, in which step, why, and where to look."""

    kind: Kind
    flow: str
    run_name: str
    run_id: str
    step: str | None
    reason: str
    url: str | None

    @property
    def subject(self) -> str:
        what = {"failed": "FAILED", "crashed": "CRASHED", "paused": "WAITING FOR APPROVAL"}[self.kind]
        return f"latentforge {self.flow} / {self.run_name}: {what}" + (f" at {self.step}" if self.step else "")

    @property
    def body(self) -> str:
        lines = [self.subject, f"reason: {self.reason}"]
        if self.url:
            lines.append(f"run: {self.url}")
        return "\n".join(lines)

    def payload(self) -> dict[str, Any]:
        """The webhook JSON: the fields, plus ``text`` (what Slack-style incoming webhooks show)."""
        return {"event": f"latentforge.flow-run.{self.kind}", **asdict(self), "text": self.body}


@dataclass(frozen=True)
class Destinations:
    webhook: str | None
    block: str | None

    def __bool__(self) -> bool:
        return bool(self.webhook or self.block)


def destinations(config: AlertConfig | None) -> Destinations:
    """The configured destinations; the config wins over the environment, each on its own."""
    webhook = (config.webhook if config else None) or os.environ.get(WEBHOOK_ENV) or None
    block = (config.block if config else None) or os.environ.get(BLOCK_ENV) or None
    return Destinations(webhook, block)


def run_url(ui_url: str | None, run_id: str) -> str | None:
    """The run's page in the Prefect UI, when a UI is known."""
    return f"{ui_url.rstrip('/')}/runs/flow-run/{run_id}" if ui_url else None


def post_webhook(url: str, alert: Alert) -> bool:
    """POST the alert as JSON; True when the receiver answered 2xx. The URL is never logged (it may hold a
    token): errors name only its host."""
    request = urllib.request.Request(
        url,
        data=json.dumps(alert.payload()).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "latentforge-alerts"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return 200 <= response.status < 300
    except (OSError, ValueError) as exc:
        host = urllib.request.urlparse(url).hostname or "?"
        logger.error("alert webhook at %s not reached: %s", host, type(exc).__name__)
        return False
