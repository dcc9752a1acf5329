"""The upload step's record: what one upload found, decided, sent and checked (`UploadRun`), written as the upload
report (``OUT/reports/upload-<UTC>.json|md``) whatever happened, and the rules it applies between the flow's
steps: the gates from the newest run report, the replace decision from a token or a policy, the refusal text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.config import UploadConfig
from infra.errors import PublishError
from infra.gates.decision import Decision, utc_now
from infra.publish.base import Target
from infra.publish.check import RemoteCheck
from infra.publish.core import SendStats
from infra.publish.diff import UploadPlan
from infra.publish.manifest import Manifest, gate_problems
from infra.report_files import REPORTS_DIR, to_json_bytes, write_new

UPLOAD_PREFIX = "upload"


class UploadGateFailed(PublishError):
    """The cache's newest run report does not show its gates passed (and --skip-gates was not given)."""


class RemoteCheckFailed(PublishError):
    """After the upload, the remote does not hold what the ledger says it should."""


def check_gates(out: Path, manifest: Manifest, config: UploadConfig, verify_only: bool) -> dict[str, Any]:
    """{skipped, problems} from the newest run report; UploadGateFailed unless the gates passed or are skipped."""
    problems = [] if verify_only else gate_problems(out, manifest.fingerprint)
    if problems and not config.skip_gates:
        raise UploadGateFailed("not uploaded: " + "; ".join(problems) + " (--skip-gates uploads anyway, logged)")
    return {"skipped": bool(problems), "problems": problems}


def standing_decision(plan: UploadPlan, config: UploadConfig, policy: str) -> Decision | None:
    """The replace decision a token or a policy makes, or None when a person has to be asked (policy ``ask``)."""
    details = {"target": plan.target.url, "conflicts": [ours.path for ours, _ in plan.conflicts]}
    if config.approve_replace is not None:
        if config.approve_replace != plan.token:
            by = "--approve-replace (does not match these conflicts)"
            return Decision(gate="upload-replace", choice="abort", how="token", by=by, details=details)
        return Decision(gate="upload-replace", choice="replace", how="token", by="--approve-replace", details=details)
    if policy == "ask":
        return None
    return Decision(gate="upload-replace", choice="abort", how="policy", by=f"on_conflict={policy}", details=details)


def refusal(plan: UploadPlan, decision: Decision | None) -> str:
    """Why conflicting remote files were not replaced, and the token that would replace exactly them."""
    listed = ", ".join(ours.path for ours, _ in plan.conflicts[:10])
    why = decision.text() if decision else "no approval"
    return (
        f"{len(plan.conflicts)} remote file(s) at {plan.target.url} differ from this cache's and were not replaced "
        f"({why}): {listed}. Files sent before this point stay; to replace exactly these: "
        f"--approve-replace {plan.token}"
    )


@dataclass
class UploadRun:
    """One upload as it goes; `write` records it, whatever stopped it."""

    out: Path
    target: Target
    verify_only: bool = False
    warnings: list[str] = field(default_factory=list)
    gates: dict[str, Any] = field(default_factory=lambda: {"skipped": False, "problems": []})
    plan: UploadPlan | None = None
    stats: SendStats | None = None
    decision: Decision | None = None
    check: RemoteCheck | None = None
    failure: PublishError | None = None

    @property
    def approved(self) -> bool:
        return self.decision is not None and self.decision.choice == "replace"

    def report(self) -> dict[str, Any]:
        """The upload report: what was there, what was sent, who approved a replace, what the check found."""
        plan, stats = self.plan, self.stats
        counts = None
        if plan is not None:
            counts = {
                "sent": len(plan.send),
                "unchanged": len(plan.unchanged),
                "updated": len(plan.update),
                "conflicts": len(plan.conflicts),
                "replaced": len(plan.conflicts) if stats is not None and self.approved else 0,
                "extra_remote": len(plan.extra),
            }
        return {
            "report": "latentforge-upload",
            "created": utc_now(),
            "out": str(self.out),
            "target": self.target.url,
            "fingerprint": plan.fingerprint if plan else None,
            "remote_fingerprint": plan.remote_fingerprint if plan else None,
            "verify_only": self.verify_only,
            "gates": self.gates,
            "counts": counts,
            "sent": {**asdict(stats), "mib_per_s": stats.mib_per_s} if stats else None,
            "decisions": [self.decision.model_dump()] if self.decision else [],
            "layout_warnings": self.warnings,
            "check": self.check.to_dict() if self.check else None,
            "failure": str(self.failure) if self.failure else None,
        }

    def markdown(self) -> str:
        lines = [f"# Upload to `{self.target.url}`", ""]
        if self.failure is not None:
            lines += [f"**FAILED**: {self.failure}", ""]
        if self.plan is not None:
            plan = self.plan
            lines += [
                f"* sent {len(plan.send)} new, updated {len(plan.update)}, unchanged {len(plan.unchanged)}, "
                f"conflicting {len(plan.conflicts)}"
            ]
        if self.decision is not None:
            lines += [f"* replace decision: {self.decision.text()}"]
        if self.stats is not None:
            stats = self.stats
            lines += [f"* {stats.files} files, {stats.bytes} bytes in {stats.seconds} s ({stats.mib_per_s} MiB/s)"]
        if self.check is not None:
            lines += ["", self.check.markdown()]
        return "\n".join(lines) + "\n"

    def write(self) -> Path:
        """``OUT/reports/upload-<UTC>.json`` (+ ``.md``), never overwritten and never published themselves."""
        files = {".json": to_json_bytes(self.report()), ".md": self.markdown().encode()}
        return write_new(REPORTS_DIR, UPLOAD_PREFIX, files, out=self.out)[0]
