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
from infra import outdir
from infra.cache.lock import out_lock
from infra.config import UploadConfig
from infra.errors import PublishError
from infra.gates.decision import Decision
from infra.publish.base import LocalFile, OnSent, Remote, RemoteConflict, parse_target
from infra.publish.diff import UploadPlan
from infra.publish.manifest import Manifest, build_manifest
from infra.publish.remotes import layout_warnings, open_remote
from infra.publish.upload_run import RemoteCheckFailed, UploadRun, check_gates, refusal, standing_decision
from tasks.upload import list_and_plan, send, verify_remote

logger = logging.getLogger(__name__)


def upload_step(
    out: Path, config: UploadConfig, *, verify_only: bool = False, approval_timeout: int = 86400
) -> dict[str, Any]:
    """Publish OUT to config.to (or only verify the remote copy). Once OUT is known to be whole, an upload report
    is written whatever happens next; a failed gate, a refused conflict or a failed remote check raise after it."""
    log = get_run_logger()
    out = outdir.root(out)
    target = parse_target(config.to)
    with step("upload"), out_lock(out):
        manifest = build_manifest(out, config, target)  # a cache that is not whole: an error, no report
        if manifest.excluded:
            log.info("%d file(s) left out by --include/--exclude", manifest.excluded)
        run = UploadRun(out, target, verify_only, warnings=layout_warnings(target, manifest.files))
        for warning in run.warnings:
            log.warning("%s", warning)
        try:
            run.gates = check_gates(out, manifest, config, verify_only)
            if run.gates["skipped"]:
                log.warning("GATES SKIPPED (--skip-gates): %s", "; ".join(run.gates["problems"]))
            remote = open_remote(target, config)
            if not verify_only:
                run.plan = _plan(manifest, remote)
                if run.plan.conflicts:
                    run.decision = _replace_decision(run.plan, config, approval_timeout)
                    if not run.approved:
                        raise RemoteConflict(refusal(run.plan, run.decision))
                run.stats = send(run.plan, remote, run.approved, _progress(run.plan))
            unchanged = run.plan is not None and run.stats is not None and run.stats.files == 0
            run.check = verify_remote(manifest, remote, run.plan.listing if unchanged and run.plan else None)
            create_markdown_artifact(run.check.markdown(), key="remote-verification", description=target.url)
            if not run.check.ok:
                run.failure = RemoteCheckFailed(run.check.text())
        except PublishError as exc:
            run.failure = exc
        path = run.write()
    log.info("upload report: %s", path)
    if run.failure is not None:
        raise run.failure
    return {**run.report(), "upload_report": str(path)}


def _plan(manifest: Manifest, remote: Remote) -> UploadPlan:
    """List the remote and plan what to send."""
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
    return plan


def _replace_decision(plan: UploadPlan, config: UploadConfig, timeout: int) -> Decision:
    """A token or a policy decides; otherwise a person is asked (a pause)."""
    decision = standing_decision(plan, config, config.on_conflict or default_policy())
    if decision is not None:
        return decision
    create_markdown_artifact(plan.conflicts_markdown(), key="remote-conflict", description=plan.target.url)
    details = {"target": plan.target.url, "conflicts": [ours.path for ours, _ in plan.conflicts]}
    unattended = f"--approve-replace {plan.token}"
    preview = plan.conflicts_markdown()
    return decide("upload-replace", ReplaceAnswer, ReplaceChoice, preview, timeout, unattended=unattended, **details)


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
    return upload_step(outdir.root(out), upload, verify_only=verify_only, approval_timeout=approval_timeout)
