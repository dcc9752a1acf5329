"""`latentforge rerun RUN_ID --failed-only`: registered on the main app in flows/cli.py (the rerun itself:
`flows.rerun_failed`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from flows.cli_options import cli_errors
from infra.config import BuildConfig
from infra.errors import ConfigError, RunFailed

Opt = typer.Option
# The gate settings' choices, as the config declares them.
OnLoss = BuildConfig.settings()["on_loss"].annotation
OnConflict = BuildConfig.settings()["on_conflict"].annotation
OnStale = BuildConfig.settings()["on_stale"].annotation


@cli_errors
def rerun(
    run_id: Annotated[str, typer.Argument(help="the flow run whose failures to redo")],
    failed_only: Annotated[
        bool, Opt("--failed-only", help="only the samples and shards that failed in RUN_ID")
    ] = False,
    dry_run: Annotated[bool, Opt("--dry-run", help="print what would be rerun")] = False,
    on_loss: Annotated[
        OnLoss, Opt(help="ask | abort | accept at the loss gate (default: RUN_ID's; a loss it accepted stays so)")
    ] = None,
    on_conflict: Annotated[OnConflict, Opt(help="ask | abort | new_dir | reuse (default: RUN_ID's)")] = None,
    on_stale: Annotated[OnStale, Opt(help="ask | abort | replace | keep (default: RUN_ID's)")] = None,
) -> None:
    """A new build run with RUN_ID's spec over only what failed in RUN_ID (from its ledger rows and report).
    RUN_ID may be given by a unique prefix of its id."""
    if not failed_only:
        raise ConfigError(
            "only `rerun RUN_ID --failed-only` exists: to run everything again, `latentforge build` resumes"
        )
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415 - heavy: Prefect

    from flows.paused_runs import resolve_run_id  # noqa: PLC0415 - heavy: Prefect
    from flows.rerun_failed import plan_rerun, start_deployment_rerun  # noqa: PLC0415 - heavy: torch, Prefect

    gates = {k: v for k, v in {"on_loss": on_loss, "on_conflict": on_conflict, "on_stale": on_stale}.items() if v}
    try:
        run_id = resolve_run_id(run_id)
        rerun = plan_rerun(run_id, gates)
    except ObjectNotFound as exc:
        raise ConfigError(f"cannot rerun {run_id}: no such flow run on this Prefect API") from exc
    except (ValueError, RuntimeError) as exc:  # a bad id, an unreachable API, a non-build run
        raise ConfigError(f"cannot rerun {run_id}: {exc}") from exc
    typer.echo(f"{len(rerun.selectors)} failed in {run_id}: {json.dumps(rerun.selectors[:20])}")
    chosen = {name: getattr(rerun.config.gates, name) for name in ("on_loss", "on_conflict", "on_stale")}
    typer.echo("gates: " + ", ".join(f"--{k.replace('_', '-')} {v or 'the default'}" for k, v in chosen.items()))
    for note in rerun.notes:
        typer.echo(note)
    if not rerun.selectors:
        typer.echo("nothing to rerun")
        return
    if dry_run:
        return
    if rerun.deployment_id:
        typer.echo(f"started {start_deployment_rerun(rerun)} on deployment {rerun.deployment_id}")
        return
    from flows.terminal_run import run_build  # noqa: PLC0415 - heavy: torch, Prefect

    ok, result = run_build(rerun.config)
    if not ok:
        raise RunFailed(str(result))
    typer.echo(
        f"rerun done: {result['encoded']} encoded, {result['failed']} still failed; run report {result['run_report']}"
    )
