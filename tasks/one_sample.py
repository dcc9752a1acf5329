"""Tasks: one sample at the planned geometry (beside OUT, never in it), and the disk check."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import outdir
from infra.gates.disk import DiskCheck, check_disk
from infra.plan import BuildPlan
from infra.preprocess.one_sample import SanityReport, run_sanity


@task(name="one-sample-sanity", cache_policy=NO_CACHE)
def one_sample_sanity(plan: BuildPlan, *, pending_only: bool = False) -> SanityReport:
    """Encode the plan's first usable sample (`pending_only`, the build's gate: the first one the build would
    encode; nothing to encode, a finished cache's resume, loads no model and reads no media) into OUT.sanity/,
    check it, time it, project the full run."""
    with outdir.snapshot(plan.out):  # under the build's lock: a store's done files by listing, not a HEAD each
        return run_sanity(plan.job, plan.shards, plan.spool, pending_only=pending_only)


@task(name="disk-check", cache_policy=NO_CACHE)
def disk_check(out: Path, projected_bytes: int) -> DiskCheck:
    """Projected bytes against the free space of OUT's file system."""
    return check_disk(out, projected_bytes)
