"""Task: resolve a BuildConfig into a BuildPlan (family, geometry, spec, shards)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import BuildConfig
from infra.plan import BuildPlan, make_plan


@task(name="plan", cache_policy=NO_CACHE)
def plan_build(config: BuildConfig, spool: Path | None = None) -> BuildPlan:
    """Check everything that can be checked without loading a model; a build lists its planned samples into `spool`
    (a directory outside OUT), recorded in OUT before the preprocess."""
    return make_plan(config, spool)
