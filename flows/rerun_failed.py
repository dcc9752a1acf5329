"""`latentforge rerun RUN_ID --failed-only`: a new build run, same spec, over only what failed in RUN_ID.

What failed is read from OUT's ledgers (rows that RUN_ID wrote as failed) and from RUN_ID's run report
(shards that crashed: rerun whole, their done samples are kept as always). The original parameters come
from the Prefect API that ran it; a deployment run is rerun as a new run of the same deployment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from infra import outdir
from infra.audit.run_report import run_report_of
from infra.cache import ledger
from infra.config import BuildConfig
from infra.errors import ConfigError

logger = logging.getLogger("flows.rerun")  # its name before the rename: the same log lines


@dataclass(frozen=True)
class Rerun:
    """What a rerun will do: the original run, its config with ``only`` set, and where it runs."""

    run_id: str
    config: BuildConfig
    selectors: list[str]
    deployment_id: str | None
    #: What the rerun carries over from RUN_ID beyond its config, each said in the rerun's output.
    notes: tuple[str, ...] = ()


def failed_selectors(out: outdir.Out, run_id: str) -> list[str]:
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


def accepted_loss(out: outdir.Out, run_id: str) -> str | None:
    """How RUN_ID's run report says its loss was accepted (``accept_loss by ... : N missing {reasons}``), or None."""
    report = run_report_of(out, run_id)
    accepted = [d for d in (report.decisions_at("loss") if report else []) if d.choice == "accept_loss"]
    if not accepted:
        return None
    details = accepted[-1].details
    return f"{accepted[-1].text()}: {details.get('shortfall')} missing {details.get('reasons')}"


def plan_rerun(run_id: str, gates: dict[str, str] | None = None) -> Rerun:
    """Read RUN_ID's parameters from the API and select what it left failed. `gates` (``on_loss``,
    ``on_conflict``, ``on_stale``) override RUN_ID's; without ``on_loss``, a loss RUN_ID accepted stays accepted
    (the rerun redoes only what failed: what it can still miss is a part of that loss)."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    raw = (run.parameters or {}).get("config")
    if raw is None:
        raise ConfigError(f"flow run {run_id} ({run.name}) is not a build-cache run (no config parameter)")
    config = BuildConfig.model_validate(raw)
    out = outdir.of_setting(config.out)
    selectors = failed_selectors(out, run_id)
    # Same spec and settings; a token approved that run's change, not this one's.
    update: dict = {"only": selectors, "approve_overwrite": None, **(gates or {})}
    notes: list[str] = []
    if "on_loss" not in update and config.gates.on_loss != "accept" and (accepted := accepted_loss(out, run_id)):
        update["on_loss"] = "accept"
        notes.append(f"the loss accepted in {run_id} stays accepted (--on-loss accept; {accepted})")
    rerun = config.with_values(**update)  # validated: the gate values given are checked as the config checks them
    return Rerun(run_id, rerun, selectors, str(run.deployment_id) if run.deployment_id else None, tuple(notes))


def start_deployment_rerun(rerun: Rerun) -> str:
    """Create the new run on the original deployment (a worker picks it up); returns its id."""
    run = run_deployment(
        name=UUID(rerun.deployment_id),  # type: ignore[arg-type]
        parameters={"config": rerun.config.model_dump(mode="json")},
        timeout=0,
        tags=["rerun", f"rerun-of:{rerun.run_id}"],
    )
    return str(run.id)
