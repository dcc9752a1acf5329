"""The main flow: plan → verify-existing → [approval] → one-sample sanity → disk → preprocess
→ reconcile-counts → [loss approval] → decode-and-verify → run report.

Later steps (the audio gate, upload) slot in around decode-and-verify; the flow holds no tensor code.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.runtime import flow_run
from prefect.states import Cancelled, State
from prefect.task_runners import ThreadPoolTaskRunner

from flows.alerting import on_crashed, on_failure
from flows.audit import audit
from flows.conflict import ConflictAborted, resolve_conflict
from flows.settings import resolve_config
from flows.shards import run_shards
from flows.stale import resolve_stale
from flows.steps import set_step
from flows.upload import upload_step
from infra import outdir
from infra.audit.inspect import cache_geometries, repeated_frames, rotated_clips
from infra.cache import ledger
from infra.cache.cachedir import finish_cache_json, has_cache_json, read_cache_json, write_cache_json
from infra.cache.lock import out_lock
from infra.config import BuildConfig
from infra.errors import DamagedCacheError, GateFailed, Preempted
from infra.faults import fault_point
from infra.gates.conflicts import keep_old_cache_json
from infra.gates.decision import Decision
from infra.ops import preempt
from infra.plan import BuildPlan
from infra.preprocess.build_summary import BuildSummary, summarize
from infra.preprocess.one_sample import SanityReport
from infra.preprocess.unvisited import record_plan
from infra.sources import retries
from infra.storage import remove_stale_temps
from tasks.one_sample import disk_check, one_sample_sanity
from tasks.plan import plan_build
from tasks.preprocess import dry_run_sample
from tasks.verify import verify_existing

#: Upper bound on threads; config.workers (≤ this) is how many shards actually run at once.
MAX_WORKERS = 16
POLL_SECONDS = 2.0


@flow(
    name="build-cache",
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_WORKERS),
    persist_result=False,
    on_failure=[on_failure],
    on_crashed=[on_crashed],
)
def build_cache(config: BuildConfig) -> dict[str, Any] | State:
    """Build (or resume) a latent cache: plan, verify OUT, gate, sanity, disk, preprocess, audit, run report,
    then upload when ``config.upload`` names a target. A run stopped by SIGTERM or Ctrl-C ends Cancelled, with
    what was done sealed (the terminal front then exits with the preempted code and the resume line)."""
    preempt.reclaim()  # SIGTERM / Ctrl-C finish the sample in flight (Prefect's own handler would crash the run)
    try:
        return _build(config)
    except Preempted as exc:
        get_run_logger().warning("%s: finished samples are sealed; the run stops here", exc)
        return Cancelled(message=f"{exc}: finished samples are sealed")


def _build(config: BuildConfig) -> dict[str, Any]:
    # the plan lists its samples into a spool outside OUT (nothing is written there before the gates decide)
    with tempfile.TemporaryDirectory(prefix="latentforge-plan-") as spools:
        return _planned_build(config, None if config.run.dry_run else Path(spools) / "listing")


def _planned_build(config: BuildConfig, spool: Path | None) -> dict[str, Any]:
    logger = get_run_logger()
    retries.take()  # what earlier work of this process retried is not this run's
    set_step("plan")
    config = resolve_config(config)  # a form's or a deployment's run: the checks a command makes before it starts
    plan = plan_build(config, spool)
    logger.info("plan: family %s, fingerprint %s, %d shards", plan.family, plan.fingerprint[:16], len(plan.shards))
    fault_point("plan")
    set_step("verify-existing")
    report = verify_existing(plan)
    logger.info("verify-existing: %s — %s", report.kind.upper(), report.message)  # its one line; in full at DEBUG,
    logger.debug("%s", report.text())  # in `latentforge verify` and, at a conflict, in the decision's artifact
    if config.run.dry_run:
        shapes = dry_run_sample(plan)
        logger.info("dry run (nothing written): %s", shapes)
        return {"dry_run": shapes, "out_state": report.kind}
    with contextlib.ExitStack() as held:  # one writer per OUT, from the gates to the last report
        if report.writable:
            held.enter_context(out_lock(plan.out))
        set_step("conflict-gate")
        plan, conflict = resolve_conflict(plan, report)
        if not report.writable:  # nothing is written into a conflicting OUT (not even the lock) before this
            held.enter_context(out_lock(plan.out))  # the decided OUT: the same one, or OUT-v2
        if conflict is not None and conflict.choice == "reuse":
            report = verify_existing(plan)  # the adopted spec's resume: its stale samples
        set_step("stale-gate")
        plan, stale = resolve_stale(plan, report)
        result = _build_locked(plan, [d for d in (conflict, stale) if d is not None])
    if config.upload is not None:  # the upload step takes the lock again itself
        uploaded = upload_step(plan.out, config.upload, approval_timeout=config.gates.approval_timeout)
        result["upload"] = {k: uploaded.get(k) for k in ("target", "counts", "sent", "upload_report")}
    return result


def _build_locked(plan: BuildPlan, decided: list[Decision]) -> dict[str, Any]:
    """Sanity, disk, preprocess, summary and audit, under OUT's writer lock (in a store cache.json is written when
    they end: `finish_cache_json`)."""
    sanity = _gates(plan)
    start = time.perf_counter()
    set_step("preprocess")
    _check_unchanged(plan)
    plan = _prepare_out(plan)
    try:
        result = _preprocess_and_audit(plan, sanity, decided, start)
    except BaseException:
        with contextlib.suppress(Exception):  # a run that stops: what it wrote is sealed (a lost lease: not even this)
            finish_cache_json(plan.out)
        raise
    finish_cache_json(plan.out)
    return result


def _preprocess_and_audit(
    plan: BuildPlan, sanity: SanityReport, decided: list[Decision], start: float
) -> dict[str, Any]:
    """The shards, their summary and the audit (reconcile, gates, decode-and-verify, the run report)."""
    results = run_shards(plan)
    summary = summarize(
        results,
        out=str(plan.out),
        fingerprint=plan.fingerprint,
        family=plan.family,
        **_geometries(plan),
        seconds=time.perf_counter() - start,
        run_id=str(flow_run.get_id()) if flow_run.get_id() else None,
        own_retries=retries.take(),  # the flow's own reads (listing, sanity): the shards took theirs
    )
    _publish(summary)
    timings = {"sanity_sample_seconds": sanity.seconds, "preprocess_seconds": summary.seconds}
    audited = audit(plan, summary.model_dump(), timings, decided)  # a crashed shard's samples are missing there
    return {**summary.model_dump(), **audited, "sanity": sanity.to_dict(), "sanity_text": sanity.text()}


def _geometries(plan: BuildPlan) -> dict[str, Any]:
    """What the summary shows of the cache as written: its geometries (a bucketed cache has several) with the format's
    output keys, how many samples had frames repeated to fill theirs, and the clips a display matrix turns."""
    rows = [row for shard in ledger.read_all(plan.out).values() for row in shard.values()]
    rows = [row for row in rows if row.fingerprint in (None, plan.fingerprint)]  # not an overwrite's, left to replace
    try:
        geometries = cache_geometries(plan.out, plan.spec.model_dump(mode="json"), rows)
    except DamagedCacheError as exc:  # verify and reconcile name it; the summary goes on without the shapes
        get_run_logger().warning("the summary shows no shapes: %s", exc)
        geometries = []
    rotated = {"clips": rotated_clips(rows), "rotate": plan.spec.rotate}
    return {"geometries": geometries, "repeated_frames": repeated_frames(rows), "rotated": rotated}


def _gates(plan: BuildPlan) -> SanityReport:
    """One-sample sanity and the disk check: hard stops before the full preprocess."""
    set_step("sanity")
    sanity = one_sample_sanity(plan, pending_only=True)  # a resume's: a sample it will encode
    get_run_logger().info("%s", sanity.text())
    create_markdown_artifact(sanity.markdown(), key="sanity", description=f"one sample of {plan.out}")
    if not sanity.ok:
        raise GateFailed("one-sample sanity failed: " + "; ".join(sanity.problems))
    set_step("disk-check")
    disk = disk_check(plan.out, sanity.projected_bytes)
    if not disk.ok:
        raise GateFailed(disk.message)
    return sanity


def _check_unchanged(plan: BuildPlan) -> None:
    """Under the lock: OUT is still what the gate saw (writable, or the state an overwrite was approved for)."""
    report = verify_existing(plan, stale=False)  # unowned files the decision covered: not a change
    if report.writable:
        return
    approved = plan.job.replace_from is not None and (report.existing_fingerprint or "foreign") == plan.job.replace_from
    if approved and not report.unowned:
        return
    raise ConflictAborted(
        f"{plan.out} changed while this run was deciding (it is {report.kind} now): nothing was written; run the "
        "same command again to decide on what is there now",
        detail=report.text(),
    )


def _prepare_out(plan: BuildPlan) -> BuildPlan:
    """cache.json, the plan recorded (`record_plan`: with the shards it carries over), temp files of a killed run
    removed; returns the plan the shards run."""
    provenance = {"model_path": str(plan.config.model), "source": plan.config.source, "recipe": plan.config.recipe}
    if plan.job.replace_from is not None and _cache_json_fingerprint(plan.out) != plan.fingerprint:
        kept = keep_old_cache_json(plan.out, plan.job.replace_from)
        get_run_logger().warning("approved overwrite of %s; old cache.json kept as %s", plan.out, kept)
        write_cache_json(plan.out, plan.spec, {**provenance, "replaces": plan.job.replace_from}, replace=True)
    elif not has_cache_json(plan.out):  # in a store: the pending one (cache.json last, `finish_cache_json`)
        write_cache_json(plan.out, plan.spec, provenance)
    for rel in sorted(plan.job.remove_unowned):  # the approved overwrite's: files no ledger row owns, as listed
        outdir.unlink(plan.out, rel)
    if plan.job.remove_unowned:
        get_run_logger().warning(
            "approved overwrite: removed %d file(s) no ledger row owned", len(plan.job.remove_unowned)
        )
    removed = remove_stale_temps(plan.out)
    if removed:
        get_run_logger().warning("removed %d partial temp files left by an interrupted run", removed)
    return plan.model_copy(update={"shards": record_plan(plan.job, plan.shards, plan.spool)})


def _cache_json_fingerprint(out: Path) -> str | None:
    """The fingerprint OUT's cache.json declares (None: no readable one). An overwrite that an interrupted run began
    has written this spec's already: it is not written again."""
    try:
        return read_cache_json(out).get("fingerprint")
    except (OSError, ValueError, outdir.UnsafePath):
        return None


def _publish(summary: BuildSummary) -> None:
    get_run_logger().info(
        "summary: %d samples, %d done (%d encoded, %d reused), %d skipped, %d failed; %s",
        summary.samples,
        summary.done,
        summary.encoded,
        summary.reused,
        summary.skipped,
        summary.failed,
        summary.reasons or "no reasons",
    )
    create_table_artifact(summary.table(), key="build-summary", description=f"latent cache {summary.out}")
