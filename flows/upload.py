"""The upload step (the build's last, or the `upload-cache` flow): gates → manifest → list the remote →
[approval to replace] → send (manifest last) → verify the remote → upload report.

Nothing on the remote is replaced unless a person approved it (the Prefect form, `latentforge approve`, or
an `--approve-replace` token bound to the target and the exact remote versions); the card and ledgers of
this same cache are the only files updated in place.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.alerting import on_crashed, on_failure
from flows.approval import ReplaceAnswer, ReplaceChoice, decide
from flows.conflict import default_policy
from flows.steps import step
from infra.cache.lock import out_lock
from infra.config import UploadConfig
from infra.publish.base import LocalFile, OnSent, PublishError, Remote, RemoteConflict, parse_target
from infra.publish.check import RemoteCheck
from infra.publish.core import SendStats, upload_report, write_upload_report
from infra.publish.diff import UploadPlan
from infra.publish.manifest import Manifest, build_manifest, gate_problems
from infra.publish.remotes import layout_warnings, open_remote
from tasks.upload import list_and_plan, send, verify_remote

logger = logging.getLogger(__name__)


class UploadGateFailed(PublishError):
    """The cache's newest run report does not show its gates passed (and --skip-gates was not given)."""


class RemoteCheckFailed(PublishError):
    """After the upload, the remote does not hold what the ledger says it should."""


def upload_step(
    out: Path, config: UploadConfig, *, verify_only: bool = False, approval_timeout: int = 86400
) -> dict[str, Any]:
    """Publish OUT to config.to (or only verify the remote copy). Once OUT is known to be whole, an upload report
    is written whatever happens next; a failed gate, a refused conflict or a failed remote check raise after it."""
    log = get_run_logger()
    out = Path(out)
    target = parse_target(config.to)
    with step("upload"), out_lock(out):
        manifest = build_manifest(out, config, target)  # a cache that is not whole: an error, no report
        if manifest.excluded:
            log.info("%d file(s) left out by --include/--exclude", manifest.excluded)
        warnings = layout_warnings(target, manifest.files)
        for warning in warnings:
            log.warning("%s", warning)
        gates: dict[str, Any] = {"skipped": False, "problems": []}
        plan: UploadPlan | None = None
        stats: SendStats | None = None
        decision: dict[str, Any] | None = None
        check: RemoteCheck | None = None
        failure: PublishError | None = None
        try:
            gates = _gates(out, manifest, config, verify_only)
            remote = open_remote(target, config)
            if not verify_only:
                plan, decision = _plan_and_decide(manifest, remote, config, approval_timeout)
                approved = decision is not None and decision["decision"] == ReplaceChoice.replace.value
                if plan.conflicts and not approved:
                    raise RemoteConflict(_refusal(plan, decision))
                stats = send(plan, remote, approved, _progress(plan))
            unchanged = plan is not None and stats is not None and stats.files == 0
            check = verify_remote(manifest, remote, plan.listing if unchanged else None)
            create_markdown_artifact(check.markdown(), key="remote-verification", description=target.url)
            if not check.ok:
                failure = RemoteCheckFailed(check.text())
        except PublishError as exc:
            failure = exc
        report = upload_report(
            plan,
            stats,
            out=out,
            target=target.url,
            gates=gates,
            decision=decision,
            check=check.to_dict() if check else None,
            warnings=warnings,
            verify_only=verify_only,
        )
        path = write_upload_report(out, report, _markdown(target.url, plan, stats, check, failure))
    log.info("upload report: %s", path)
    if failure is not None:
        raise failure
    return {**report, "upload_report": str(path)}


def _plan_and_decide(
    manifest: Manifest, remote: Remote, config: UploadConfig, approval_timeout: int
) -> tuple[UploadPlan, dict[str, Any] | None]:
    """List the remote and plan; when files conflict, the decision (a token, a person, or abort)."""
    plan = list_and_plan(manifest, remote)
    get_run_logger().info(
        "%s: %d to send, %d unchanged, %d to update, %d conflicting (%d bytes to send)",
        plan.target.url,
        len(plan.send),
        len(plan.unchanged),
        len(plan.update),
        len(plan.conflicts),
        plan.bytes_to_send,
    )
    return plan, _replace_decision(plan, config, approval_timeout) if plan.conflicts else None


def _gates(out: Path, manifest: Manifest, config: UploadConfig, verify_only: bool) -> dict[str, Any]:
    problems = [] if verify_only else gate_problems(out, manifest.fingerprint)
    if problems and not config.skip_gates:
        raise UploadGateFailed("not uploaded: " + "; ".join(problems) + " (--skip-gates uploads anyway, logged)")
    if problems:
        get_run_logger().warning("GATES SKIPPED (--skip-gates): %s", "; ".join(problems))
    return {"skipped": bool(problems), "problems": problems}


def _replace_decision(plan: UploadPlan, config: UploadConfig, timeout: int) -> dict[str, Any]:
    if config.approve_replace is not None:
        if config.approve_replace != plan.token:
            return {"decision": "abort", "who": "--approve-replace token does not match these conflicts"}
        return {"decision": ReplaceChoice.replace.value, "who": "approved by --approve-replace token"}
    policy = config.on_conflict or default_policy()
    if policy == "ask":
        create_markdown_artifact(plan.conflicts_markdown(), key="remote-conflict", description=plan.target.url)
        choice, who = decide("upload-replace", ReplaceAnswer, ReplaceChoice, plan.conflicts_markdown(), timeout)
        return {"decision": choice.value, "who": who}
    return {"decision": "abort", "who": f"on_conflict={policy}"}


def _refusal(plan: UploadPlan, decision: dict[str, Any] | None) -> str:
    listed = ", ".join(ours.path for ours, _ in plan.conflicts[:10])
    why = decision["who"] if decision else "no approval"
    return (
        f"{len(plan.conflicts)} remote file(s) at {plan.target.url} differ from this cache's and were not replaced "
        f"({why}): {listed}. Files sent before this point stay; to replace exactly these: "
        f"--approve-replace {plan.token}"
    )


def _progress(plan: UploadPlan) -> OnSent:
    total = max(plan.bytes_to_send, 1)
    artifact = create_progress_artifact(0.0, key="upload-progress", description=f"{plan.target.url}: {total} bytes")
    done = {"bytes": 0, "files": 0}

    def on_sent(file: LocalFile) -> None:
        done["bytes"] += file.size
        done["files"] += 1
        update_progress_artifact(artifact, 100.0 * done["bytes"] / total)
        if done["files"] % 100 == 0:
            logger.info("uploaded %d files, %d of %d bytes", done["files"], done["bytes"], total)

    return on_sent


def _markdown(
    target: str, plan: UploadPlan | None, stats: SendStats | None, check: RemoteCheck | None, failure: Exception | None
) -> str:
    lines = [f"# Upload to `{target}`", ""]
    if failure is not None:
        lines += [f"**FAILED**: {failure}", ""]
    if plan is not None:
        lines += [
            f"* sent {len(plan.send)} new, updated {len(plan.update)}, unchanged {len(plan.unchanged)}, "
            f"conflicting {len(plan.conflicts)}"
        ]
    if stats is not None:
        lines += [f"* {stats.files} files, {stats.bytes} bytes in {stats.seconds} s ({stats.mib_per_s} MiB/s)"]
    if check is not None:
        lines += ["", check.markdown()]
    return "\n".join(lines) + "\n"


@flow(
    name="upload-cache",
    task_runner=ThreadPoolTaskRunner(max_workers=4),
    persist_result=False,
    on_failure=[on_failure],
    on_crashed=[on_crashed],
)
def upload_cache(
    out: str, upload: UploadConfig, verify_only: bool = False, approval_timeout: int = 86400
) -> dict[str, Any]:
    """Publish a finished cache (or verify its remote copy): `latentforge upload OUT --to TARGET`."""
    return upload_step(Path(out), upload, verify_only=verify_only, approval_timeout=approval_timeout)
