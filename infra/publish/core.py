"""Send an UploadPlan stage by stage (data, reports, card, ledgers, manifest last); the stores check the local
bytes against the ledger as they leave.

Resuming needs no state of its own: every upload lists the remote first and sends only what is not there
with the same size and sha256, so a killed upload resumes by running it again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from infra.publish.base import ROLE_ORDER, LocalFile, OnSent, PublishError, Remote, RemoteFile
from infra.publish.diff import UploadPlan

logger = logging.getLogger(__name__)


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
