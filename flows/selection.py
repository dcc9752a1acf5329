"""What a build selected (``limit``, ``shard_filter``, ``max_samples_per_shard``, ``only``), as the standalone
steps (`reconcile`, `verify`, `decode`) read it back.

It is recorded with the cache by every run: the run report (``OUT/reports/run-*.json``) holds the run's config.
The newest report of the cache's own fingerprint is the build's selection; the selection is no part of the
fingerprint (it decides which samples, not their bytes). A step given other values uses them, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.audit.run_report import newest_run_report
from infra.cache.cachedir import read_cache_json
from infra.errors import LatentforgeError

#: The config keys that choose which samples a build takes.
SELECTION = ("limit", "shard_filter", "max_samples_per_shard", "only")


def recorded_selection(out: Path) -> tuple[dict[str, Any], Path | None]:
    """The selection of the newest run report under OUT that wrote OUT's fingerprint ({} and None without one)."""
    try:
        fingerprint = read_cache_json(out).get("fingerprint")
    except (OSError, ValueError, LatentforgeError):
        return {}, None
    found = newest_run_report(out, lambda report: fingerprint is None or report.fingerprint == fingerprint)
    if found is None:
        return {}, None
    report, path = found
    config = {**report.config, **(report.config.get("selection") or {})}  # nested since the sections, flat before
    return {k: config[k] for k in SELECTION if config.get(k) is not None}, path


def with_selection(out: Path, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`given` (file and flags) with the build's selection under it, and a note for each value given that differs
    from the build's."""
    recorded, path = recorded_selection(out)
    notes = [
        f"the build selected --{key.replace('_', '-')} {_shown(recorded.get(key))} ({path.name}); "
        f"this step uses {_shown(given[key])}, as given"
        for key in SELECTION
        if path is not None and given.get(key) is not None and given[key] != recorded.get(key)
    ]
    return {**recorded, **{k: v for k, v in given.items() if v is not None}}, notes


def _shown(value: Any) -> str:
    if value is None:
        return "nothing"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
