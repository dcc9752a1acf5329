"""Process-wide defaults for running offline: no telemetry, hub downloads off unless asked."""

from __future__ import annotations

import os

OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry (errors offline otherwise)
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_UI_SHOW_PROMOTIONAL_CONTENT": "false",
}


def apply_offline_defaults() -> None:
    """Set each default unless the user already set the variable (their value wins)."""
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
