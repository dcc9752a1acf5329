"""Reports under ``OUT/reports/``: the run report (one JSON per run) and the naming rule every report shares.

A report is named ``<kind>-<UTC YYYYmmddTHHMMSSZ>[-N].<ext>`` and never overwritten: when a name is taken
(two reports in the same second), the next free ``-2``, ``-3``, ... is used, and the files go through
`atomic_write` without ``replace``, so even a racing writer cannot clobber one. "Newest" orders by the
timestamp, then by that number (``-10`` after ``-9``, and the unnumbered name first).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import astuple, fields
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from infra.cache.storage import atomic_write
from infra.gates.plan import BuildPlan

logger = logging.getLogger(__name__)

REPORTS_DIR = "reports"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
RUN_PREFIX = "run"
RUN_REPORT_VERSION = 1
#: Summary fields that become the run report's counts.
COUNT_FIELDS = ("samples", "done", "skipped", "failed", "encoded", "reused", "bytes")
_NAME = re.compile(r"^(?P<prefix>[a-z]+)-(?P<stamp>\d{8}T\d{6}Z)(?:-(?P<n>[1-9]\d*))?$")


def reports_dir(out: Path) -> Path:
    """``OUT/reports``."""
    return Path(out) / REPORTS_DIR


def utc_stamp(now: datetime | None = None) -> str:
    """A UTC timestamp for a report name: ``YYYYmmddTHHMMSSZ``."""
    return (now or datetime.now(UTC)).astimezone(UTC).strftime(STAMP_FORMAT)


def report_order(path: Path, prefix: str) -> tuple[str, int] | None:
    """Sort key of a report file named by `write_new` with `prefix`; None for any other name."""
    match = _NAME.fullmatch(path.name.split(".", 1)[0])
    if match is None or match["prefix"] != prefix:
        return None
    return match["stamp"], int(match["n"] or 1)


def write_new(directory: Path, prefix: str, files: Mapping[str, bytes], *, stamp: str | None = None) -> list[Path]:
    """Write ``<prefix>-<stamp>[-N]<suffix>`` for each suffix → bytes in `files`, with the first N at which
    none of the names exists; never overwrites. Returns the paths in the order of `files`."""
    stamp = stamp or utc_stamp()
    for n in itertools.count(1):
        stem = f"{prefix}-{stamp}" if n == 1 else f"{prefix}-{stamp}-{n}"
        paths = [Path(directory) / f"{stem}{suffix}" for suffix in files]
        if any(p.exists() for p in paths):
            continue
        written: list[Path] = []
        try:
            for path, data in zip(paths, files.values(), strict=True):
                written.append(atomic_write(path, data).path)
        except FileExistsError:  # a racing writer took a name after the check: drop our part, try the next N
            for path in written:
                path.unlink(missing_ok=True)
            continue
        logger.info("wrote %s", ", ".join(str(p) for p in written))
        return written
    raise AssertionError("unreachable")  # pragma: no cover


#: A report section: (title, column names, rows of cells). Tables render the same in markdown and a terminal.
Section = tuple[str, list[str], list[list[Any]]]


def _cell(value: Any, *, markdown: bool = True) -> str:
    text = "—" if value is None or value == "" else " ".join(str(value).split())
    return text.replace("|", "\\|") if markdown else text


def dataclass_rows(kind: type, items: list[Any]) -> tuple[list[str], list[list[Any]]]:
    """A list of dataclass instances as (column names, rows) for a section."""
    return [f.name for f in fields(kind)], [list(astuple(item)) for item in items]


def shown(items: list[Any], limit: int | None) -> str:
    """``"N"``, or ``"first LIMIT of N"`` when a listing is cut at `limit`."""
    return f"first {limit} of {len(items)}" if limit is not None and len(items) > limit else str(len(items))


def render_markdown(title: str, intro: list[str], sections: list[Section]) -> str:
    """``## title``, intro lines, then one table per section (a section with no rows is left out)."""
    lines = [f"## {title}", "", *(f"* {_cell(line)}" for line in intro)]
    for name, header, rows in sections:
        if rows:
            lines += ["", f"### {name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_text(title: str, intro: list[str], sections: list[Section]) -> str:
    """The same for a terminal: aligned columns."""
    lines = [title, *(f"  {line}" for line in intro)]
    for name, header, rows in sections:
        if rows:
            table = [header, *([_cell(c, markdown=False) for c in row] for row in rows)]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines += ["", f"{name}:"]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines) + "\n"


def to_json_bytes(data: Mapping[str, Any]) -> bytes:
    """Sorted keys, indented, UTF-8; paths and times as strings."""
    return (json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n").encode()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Installed versions of latentforge and the libraries that decide the bytes or run the flow."""
    return {name: _version(name) for name in ("latentforge", "torch", "prefect", "diffusers", "transformers", "av")}


def run_report(
    plan: BuildPlan,
    summary: Mapping[str, Any],
    *,
    reconciliation: Mapping[str, Any] | None,
    decode: Mapping[str, Any] | None,
    decisions: list[dict[str, Any]],
    timings: Mapping[str, float],
    flow_run_id: str | None = None,
) -> dict[str, Any]:
    """The run report: what was built from what, with which model and spec, what came out, who decided what.

    `summary` is a `BuildSummary.model_dump()`; `reconciliation` a `ReconcileReport.to_dict()`; `decisions`
    one dict per gate decision, each with at least ``gate`` and ``decision`` (e.g. ``{"gate": "loss",
    "decision": "accept_loss", "by": "...", "note": "..."}``); `timings` seconds per step."""
    for decision in decisions:
        if not {"gate", "decision"} <= decision.keys():
            raise ValueError(f"a decision needs 'gate' and 'decision': {decision!r}")
    # Tokens are approvals, not settings; a webhook URL may hold a secret.
    hidden: dict[str, Any] = {"approve_overwrite": True, "upload": {"approve_replace"}, "alerts": {"webhook"}}
    config = plan.config.model_dump(mode="json", exclude=hidden)
    return {
        "report": "latentforge-run",
        "report_version": RUN_REPORT_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "flow_run_id": flow_run_id,
        "out": str(plan.out),
        "source": plan.config.source,
        "model": {"path": plan.config.model, "family": plan.family, "identity": dict(plan.spec.model_identity)},
        "spec": plan.spec.model_dump(mode="json"),
        "fingerprint": plan.fingerprint,
        "config": config,
        "shards": [{"id": s.id, "quota": s.quota, "samples": s.samples} for s in plan.shards],
        "counts": {name: summary.get(name) for name in COUNT_FIELDS},
        "reasons": dict(summary.get("reasons") or {}),
        "shard_errors": dict(summary.get("shard_errors") or {}),
        "timings": {step: round(float(seconds), 3) for step, seconds in timings.items()},
        "reconciliation": dict(reconciliation) if reconciliation is not None else None,
        "decode": dict(decode) if decode is not None else None,
        "decisions": [dict(d) for d in decisions],
        "versions": versions(),
    }


def write_run_report(out: Path, report: Mapping[str, Any]) -> Path:
    """``OUT/reports/run-<UTC stamp>[-N].json`` (sorted keys); a new file per call, never an overwrite."""
    (path,) = write_new(reports_dir(out), RUN_PREFIX, {".json": to_json_bytes(report)})
    return path


def latest_run_report(out: Path) -> dict[str, Any] | None:
    """The newest run report under OUT (by name: timestamp, then collision number), or None if there is none.

    Raises ValueError when the newest one cannot be read: an older report is never silently used instead."""
    directory = reports_dir(out)
    named = [(key, p) for p in directory.glob(f"{RUN_PREFIX}-*.json") if (key := report_order(p, RUN_PREFIX))]
    if not named:
        return None
    _, newest = max(named)
    try:
        data = json.loads(newest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{newest}: unreadable run report ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{newest}: a run report is a JSON object, not {type(data).__name__}")
    return data
