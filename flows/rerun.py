"""`latentforge rerun RUN_ID --failed-only`: a new build run, same spec, over only what failed in RUN_ID.

What failed is read from OUT's ledgers (rows that RUN_ID wrote as failed) and from RUN_ID's run report
(shards that crashed: rerun whole, their done samples are kept as always). The original parameters come
from the Prefect API that ran it; a deployment run is rerun as a new run of the same deployment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from infra.audit.run_report import run_report_of
from infra.cache import ledger
from infra.config import BuildConfig
from infra.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rerun:
    """What a rerun will do: the original run, its config with ``only`` set, and where it runs."""

    run_id: str
    config: BuildConfig
    selectors: list[str]
    deployment_id: str | None


def failed_selectors(out: Path, run_id: str) -> list[str]:
    """``SHARD/KEY`` for each sample RUN_ID left failed (and still failed now), ``SHARD`` for each shard it crashed."""
    selectors = {
        f"{shard}/{key}"
        for shard, rows in ledger.read_all(out).items()
        for key, row in rows.items()
        if row.status == "failed" and row.extra.get("run_id") == run_id
    }
    report = run_report_of(out, run_id)
    selectors |= set(report.shard_errors) if report is not None else set()
    return sorted(selectors)


def plan_rerun(run_id: str) -> Rerun:
    """Read RUN_ID's parameters from the API and select what it left failed."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    raw = (run.parameters or {}).get("config")
    if raw is None:
        raise ConfigError(f"flow run {run_id} ({run.name}) is not a build-cache run (no config parameter)")
    config = BuildConfig.model_validate(raw)
    selectors = failed_selectors(Path(config.out), run_id)
    # Same spec and settings; a token approved that run's change, not this one's.
    rerun = config.model_copy(update={"only": selectors, "approve_overwrite": None})
    return Rerun(run_id, rerun, selectors, str(run.deployment_id) if run.deployment_id else None)


def start_deployment_rerun(rerun: Rerun) -> str:
    """Create the new run on the original deployment (a worker picks it up); returns its id."""
    run = run_deployment(
        name=UUID(rerun.deployment_id),  # type: ignore[arg-type]
        parameters={"config": rerun.config.model_dump(mode="json")},
        timeout=0,
        tags=["rerun", f"rerun-of:{rerun.run_id}"],
    )
    return str(run.id)
