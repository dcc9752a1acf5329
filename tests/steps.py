"""The steps over a whole plan, each handed its part of a `BuildPlan` as its task hands it (`tasks/`): the job, the
plan's shards, and its listing where the step reads one."""

from __future__ import annotations

from typing import Any

from infra.audit.reconcile import ReconcileReport, reconcile
from infra.gates.verify import VerifyReport, verify_plan
from infra.plan import BuildPlan
from infra.preprocess.one_sample import SanityReport, run_sanity


def reconciled(plan: BuildPlan, content: bool = False) -> ReconcileReport:
    """`reconcile` over `plan` (`tasks.reconcile.reconcile_counts`, without its report file)."""
    return reconcile(plan.job, plan.shards, plan.source_shards, content=content)


def verified(plan: BuildPlan, **options: Any) -> VerifyReport:
    """`verify_plan` over `plan` (`tasks.verify.verify_existing`)."""
    return verify_plan(plan.job, plan.shards, plan.spool, **options)


def sanity(plan: BuildPlan, **options: Any) -> SanityReport:
    """`run_sanity` over `plan` (`tasks.one_sample.one_sample_sanity`)."""
    return run_sanity(plan.job, plan.shards, plan.spool, **options)
