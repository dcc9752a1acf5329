"""The upload step as plain functions: send an UploadPlan stage by stage (data, reports, card, ledgers,
manifest last), check local bytes against the ledger before they leave, and write the upload report.

Resuming needs no state of its own: every upload lists the remote first and sends only what is not there
with the same size and sha256, so a killed upload resumes by running it again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra.audit.reports import reports_dir, to_json_bytes, write_new
from infra.publish.base import ROLE_ORDER, LocalFile, OnSent, PublishError, Remote, RemoteFile
from infra.publish.diff import UploadPlan

logger = logging.getLogger(__name__)

UPLOAD_PREFIX = "upload"


@dataclass
class SendStats:
    """What one upload sent."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    by_role: dict[str, int] = field(default_factory=dict)

    @property
    def mib_per_s(self) -> float:
        return round(self.bytes / (1 << 20) / self.seconds, 2) if self.seconds > 0 else 0.0


def send_plan(plan: UploadPlan, remote: Remote, *, replace_conflicts: bool, on_sent: OnSent | None = None) -> SendStats:
    """Send new files, in-place updates and (when approved) conflicting files, one stage per role in order."""
    stats = SendStats()
    replacing: list[tuple[LocalFile, RemoteFile]] = plan.update + (plan.conflicts if replace_conflicts else [])
    if plan.conflicts and not replace_conflicts:
        raise PublishError(f"{len(plan.conflicts)} conflicting remote file(s) and no approval to replace them")
    start = time.perf_counter()

    def sent(file: LocalFile) -> None:
        stats.files += 1
        stats.bytes += file.size
        stats.by_role[file.role] = stats.by_role.get(file.role, 0) + 1
        if on_sent is not None:
            on_sent(file)

    for role in sorted(ROLE_ORDER, key=ROLE_ORDER.__getitem__):
        replace = {ours.path: theirs for ours, theirs in replacing if ours.role == role}
        files = sorted(
            [f for f in plan.send if f.role == role] + [o for o, _ in replacing if o.role == role], key=lambda f: f.path
        )
        if not files:
            continue
        logger.info("sending %d %s file(s) (%d replacing) to %s", len(files), role, len(replace), plan.target.url)
        remote.send(files, replace=replace, on_sent=sent)
    stats.seconds = round(time.perf_counter() - start, 3)
    return stats


def upload_report(
    plan: UploadPlan | None,
    stats: SendStats | None,
    *,
    out: Path,
    target: str,
    gates: dict[str, Any],
    decision: dict[str, Any] | None,
    check: dict[str, Any] | None,
    warnings: list[str],
    verify_only: bool,
) -> dict[str, Any]:
    """The upload report: what was there, what was sent, who approved a replace, what the remote check found."""
    counts = None
    if plan is not None:
        approved = stats is not None and decision is not None and decision.get("decision") == "replace"
        counts = {
            "sent": len(plan.send),
            "unchanged": len(plan.unchanged),
            "updated": len(plan.update),
            "conflicts": len(plan.conflicts),
            "replaced": len(plan.conflicts) if approved else 0,
            "extra_remote": len(plan.extra),
        }
    return {
        "report": "latentforge-upload",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "out": str(out),
        "target": target,
        "fingerprint": plan.fingerprint if plan else None,
        "remote_fingerprint": plan.remote_fingerprint if plan else None,
        "verify_only": verify_only,
        "gates": gates,
        "counts": counts,
        "sent": {**asdict(stats), "mib_per_s": stats.mib_per_s} if stats else None,
        "decision": decision,
        "layout_warnings": warnings,
        "check": check,
    }


def write_upload_report(out: Path, report: dict[str, Any], markdown: str) -> Path:
    """``OUT/reports/upload-<UTC>.json`` (+ ``.md``), never overwritten and never published themselves."""
    paths = write_new(reports_dir(out), UPLOAD_PREFIX, {".json": to_json_bytes(report), ".md": markdown.encode()})
    return paths[0]
