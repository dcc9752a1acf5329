"""Tasks: the one-sample dry run and the per-shard preprocess."""

from __future__ import annotations

import contextlib
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from infra.errors import InputError
from infra.gates.plan import BuildPlan, ShardPlan
from infra.preprocess import progress
from infra.preprocess.shard import ShardResult, encode_sample, load_encoder, process_shard
from infra.sources import open_source


@task(name="preprocess-shard", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def preprocess_shard(plan: BuildPlan, shard: ShardPlan, run_key: str) -> ShardResult:
    """Encode one shard; resumes from its ledger, so a retry redoes only what is not done."""
    run_id = flow_run.get_id()
    return process_shard(plan, shard, on_row=lambda row: progress.report(run_key, row), run_id=run_id)


@task(name="dry-run", cache_policy=NO_CACHE)
def dry_run_sample(plan: BuildPlan) -> dict[str, Any]:
    """Encode the first usable sample in memory and return its shapes; nothing is written."""
    encoder = load_encoder(plan)
    skipped: list[str] = []
    for shard in plan.shards:
        with contextlib.closing(open_source(plan.config.source).samples(shard.shard)) as samples:
            for ref in samples:
                try:
                    sample, text = encode_sample(ref, plan, lambda: encoder)
                except InputError as exc:
                    skipped.append(f"{ref.key}: {exc}")
                    continue
                return {
                    "sample": f"{sample.group}/{sample.id}",
                    "x0": [list(sample.latents.shape), str(sample.latents.dtype)],
                    "text_embeds": [list(sample.text_embeds.shape), str(sample.text_embeds.dtype)],
                    "seq_len": sample.seq_len,
                    "source_shape": sample.source_shape,
                    "skipped_before": skipped,
                    **text,
                }
    raise InputError("no_usable_sample", f"no sample could be encoded; skipped: {skipped}")
