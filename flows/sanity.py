"""The `sanity-check` flow: plan → verify-existing → one-sample sanity → disk check, and nothing else.

What a person runs before committing a GPU host to a full build (the `sanity` deployment): the same tasks as
`build-cache`'s gates, so the answer is the one the build would get. The one sample is written beside OUT
(`OUT.sanity/`); nothing is written into OUT and nothing pauses (what OUT holds is reported, not decided).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.alerting import on_crashed, on_failure
from flows.settings import resolve_config
from flows.steps import set_step
from infra.config import BuildConfig
from infra.errors import GateFailed
from infra.gates.disk import DiskCheck
from infra.gates.verify import VerifyReport
from infra.preprocess.one_sample import SanityReport
from tasks.one_sample import disk_check, one_sample_sanity
from tasks.plan import plan_build
from tasks.verify import verify_existing


class SanityFailed(GateFailed):
    """The sample could not be encoded and checked, or the disk cannot hold the projected cache."""


@flow(name="sanity-check", persist_result=False, on_failure=[on_failure], on_crashed=[on_crashed])
def sanity_check(config: BuildConfig) -> dict[str, Any]:
    """One real sample at the planned geometry, checked and timed, with the disk check; fails when either fails."""
    logger = get_run_logger()
    set_step("plan")
    plan = plan_build(resolve_config(config))
    logger.info("plan: family %s, fingerprint %s, %d shards", plan.family, plan.fingerprint[:16], len(plan.shards))
    set_step("verify-existing")
    existing = verify_existing(plan)
    logger.info("%s", existing.text())
    set_step("sanity")
    sanity = one_sample_sanity(plan)
    logger.info("%s", sanity.text())
    set_step("disk-check")
    disk = disk_check(plan.out, sanity.projected_bytes) if sanity.ok else None
    if disk is not None:
        logger.info("%s", disk.message)
    create_markdown_artifact(_markdown(sanity, disk, existing), key="sanity", description=f"one sample of {plan.out}")
    problems = [*sanity.problems, *([disk.message] if disk is not None and not disk.ok else [])]
    if problems:
        raise SanityFailed("; ".join(problems))
    return {
        "out_state": existing.kind,
        "sanity": sanity.to_dict(),
        "sanity_text": sanity.text(),
        "disk": {"ok": disk.ok, "message": disk.message} if disk else None,
    }


def _markdown(sanity: SanityReport, disk: DiskCheck | None, existing: VerifyReport) -> str:
    """The sanity table, the disk line and what OUT holds, in one artifact."""
    disk_line = disk.message if disk is not None else "not checked (no projection without a good sample)"
    return "\n".join([sanity.markdown(), "", f"**disk**: {disk_line}", "", existing.markdown()])
