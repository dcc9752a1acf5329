"""Tasks: the one-sample dry run and the per-shard preprocess."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from infra.errors import DiskFull
from infra.gates.plan import BuildPlan, ShardPlan
from infra.gates.sanity import dry_run
from infra.preprocess import progress
from infra.preprocess.shard import ShardResult, process_shard


def _retry_unless_disk_full(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed shard, but not one that found the disk full: that needs a person to free space."""
    del task, task_run
    try:
        state.result()
    except DiskFull:
        return False
    except BaseException:  # noqa: BLE001 - any other failure is retried once
        return True
    return True


@task(
    name="preprocess-shard",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_retry_unless_disk_full,
)
def preprocess_shard(plan: BuildPlan, shard: ShardPlan, run_key: str) -> ShardResult:
    """Encode one shard; resumes from its ledger, so a retry redoes only what is not done."""
    run_id = flow_run.get_id()
    return process_shard(plan, shard, on_row=lambda row: progress.report(run_key, row), run_id=run_id)


@task(name="dry-run", cache_policy=NO_CACHE)
def dry_run_sample(plan: BuildPlan) -> dict[str, Any]:
    """Encode the first usable sample in memory and return its shapes; nothing is written (the sanity's code)."""
    return dry_run(plan)
