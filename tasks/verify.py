"""Task: what does OUT hold, compared with the plan? Reads only (JSON and weights_only loads)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra import outdir
from infra.gates.verify import VerifyReport, verify_plan
from infra.plan import BuildPlan


@task(name="verify-existing", cache_policy=NO_CACHE)
def verify_existing(plan: BuildPlan, stale: bool = True) -> VerifyReport:
    """Classify OUT (absent, compatible, incompatible, foreign, damaged) with what differs and one sample checked;
    for a resume, the samples whose source changed since (stale)."""
    with outdir.snapshot(plan.out):  # a store's done files checked by listing their folders, not a HEAD each
        return verify_plan(plan.job, plan.shards, plan.spool, stale=stale)
