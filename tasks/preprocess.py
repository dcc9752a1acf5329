"""Tasks: the one-sample dry run and the per-shard preprocess."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from infra.cache.listing import Packed, task_spool
from infra.cache.lock import follow
from infra.errors import OutWriteError
from infra.job import Job
from infra.ops import runners
from infra.ops.progress import RunState
from infra.outdir import UnsafePath
from infra.plan import BuildPlan, ShardPlan
from infra.preprocess.chunks import Chunk
from infra.preprocess.chunks import merge as chunks_merge
from infra.preprocess.one_sample import dry_run
from infra.preprocess.shard import process_shard
from infra.preprocess.shard_result import ShardResult


def _retry_unless_out_refuses(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed shard, but not one that found OUT full or read-only, or a link under OUT: those need a person
    (to free space, to make it writable, to replace the link)."""
    del task, task_run
    try:
        state.result()
    except (OutWriteError, UnsafePath):
        return False
    except BaseException:  # noqa: BLE001 - any other failure is retried once
        return True
    return True


@task(
    name="preprocess-shard",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_retry_unless_out_refuses,
)
def preprocess_shard(
    job: Job,
    shard: ShardPlan,
    run: RunState,
    chunk: Chunk | None = None,
    device: str | None = None,
    listing: str | Packed | None = None,
) -> ShardResult:
    """Encode one shard (or one chunk of it) of `run` under the plan's `job` on `device` (the placement's:
    ``cuda:N``; None: the configured one); resumes from its ledger, so a retry redoes only what is not done. Runs in
    the flow's process or in a Ray worker (the job is what travels): progress goes where the runner says. `listing`:
    the plan's spool of its listing, where this process can read it, or the shard's part of it carried with the task
    (`infra.cache.listing.packed`: a Ray worker on another host); a shard with nothing to encode is not listed again,
    a tar in a store is made from the plan's records of it."""
    on_row = runners.row_reporter(run)
    if device is not None:
        job = job.placed(device)
    with (
        task_spool(listing, shard.id) as spool,
        follow(None if run.counting else run.lease),  # another process: its writes stop when the run's lease is lost
    ):
        return process_shard(job, shard, on_row=on_row, run_id=flow_run.get_id(), chunk=chunk, run=run, listing=spool)


@task(name="merge-chunks", cache_policy=NO_CACHE)
def merge_chunks(plan: BuildPlan, shard: ShardPlan, chunks: list[Chunk], results: list[ShardResult]) -> ShardResult:
    """Seal a chunked shard's ledger from its parts, once every chunk has ended."""
    return chunks_merge(plan.out, shard.id, chunks, results)


@task(name="dry-run", cache_policy=NO_CACHE)
def dry_run_sample(plan: BuildPlan) -> dict[str, Any]:
    """Encode the first usable sample in memory and return its shapes; nothing is written (the sanity's code)."""
    return dry_run(plan.job, plan.shards, plan.spool)
