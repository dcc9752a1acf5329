"""Task: count reconciliation — every source sample accounted for, reports written under OUT/reports/."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import outdir
from infra.audit.reconcile import ReconcileReport, reconcile, write_reconcile_report
from infra.plan import BuildPlan


@task(name="reconcile-counts", cache_policy=NO_CACHE)
def reconcile_counts(plan: BuildPlan) -> ReconcileReport:
    """Expected (the source listing) against produced (per output kind); missing samples with their reasons."""
    with outdir.snapshot(plan.out):  # under the build's lock: a store's sizes by listing, not a HEAD a sample
        report = reconcile(plan.job, plan.shards, plan.source_shards)
    write_reconcile_report(plan.out, report)
    return report
