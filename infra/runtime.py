"""Process-wide defaults for running offline: no telemetry, hub downloads off unless asked."""

from __future__ import annotations

import os
from pathlib import Path

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


def machine_cache(name: str) -> Path:
    """One folder of this machine's cache, the one home of them all (fetched models, file hashes, kept listings,
    sanity samples): ``$LATENTFORGE_CACHE_DIR/<name>``, else ``$XDG_CACHE_HOME/latentforge/<name>``, else
    ``~/.cache/latentforge/<name>``. Safe to delete: what is in it is made again when needed."""
    root = os.environ.get("LATENTFORGE_CACHE_DIR")
    if root:
        return Path(root).expanduser() / name
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "latentforge" / name
