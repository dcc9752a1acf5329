"""`latentforge upload` and `latentforge rerun`: registered on the main app in flows/cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from infra.config import UploadConfig

Opt = typer.Option


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def upload(
    out: Annotated[Path, typer.Argument(help="cache root")],
    to: Annotated[str, Opt("--to", help="hf://datasets/ORG/NAME (@REV, /PATH optional) or s3://BUCKET/PREFIX")],
    include: Annotated[list[str] | None, Opt("--include", help="only data/report paths matching (repeatable)")] = None,
    exclude: Annotated[list[str] | None, Opt("--exclude", help="leave out data/report paths matching")] = None,
    verify_only: Annotated[
        bool, Opt("--verify-only", help="send nothing; check the remote against the ledger")
    ] = False,
    skip_gates: Annotated[bool, Opt("--skip-gates", help="upload although the run report shows a gate failed")] = False,
    approve_replace: Annotated[str | None, Opt(help="token printed by a refused upload")] = None,
    on_conflict: Annotated[str | None, Opt(help="ask|abort when remote files differ [ask on a server]")] = None,
    workers: Annotated[int | None, Opt(help="parallel transfers [8]")] = None,
    chunk_mb: Annotated[int | None, Opt(help="S3 multipart part size in MiB [64]")] = None,
    commit_every: Annotated[int | None, Opt(help="Hub: files per commit [100]")] = None,
    license: Annotated[str | None, Opt("--license", help="dataset card license [other]")] = None,  # noqa: A002
    public: Annotated[bool, Opt("--public", help="Hub: create the repo public (default private)")] = False,
    hub_token_block: Annotated[str | None, Opt(help="Prefect Secret block with the Hub token")] = None,
    aws_credentials_block: Annotated[str | None, Opt(help="prefect-aws AwsCredentials block")] = None,
    approval_timeout: Annotated[int, Opt(help="seconds a replace approval waits; then abort")] = 86400,
) -> None:
    """Publish a finished cache (after its gates passed), resumably; verify the remote against the ledger.

    Exit 0 when the remote holds exactly the cache, 1 when a gate, a conflict or the check failed."""
    values = {
        "to": to,
        "include": include or [],
        "exclude": exclude or [],
        "skip_gates": skip_gates,
        "approve_replace": approve_replace,
        "on_conflict": on_conflict,
        "workers": workers,
        "chunk_mb": chunk_mb,
        "commit_every": commit_every,
        "license": license,
        "private": not public,
        "hub_token_block": hub_token_block,
        "aws_credentials_block": aws_credentials_block,
    }
    try:
        config = UploadConfig.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    from flows.run import run_flow  # noqa: PLC0415
    from flows.upload import upload_cache  # noqa: PLC0415

    ok, result = run_flow(
        upload_cache, out=str(out), upload=config, verify_only=verify_only, approval_timeout=approval_timeout
    )
    if not ok:
        _fail(str(result), code=1)
    counts, sent = result.get("counts"), result.get("sent")
    if counts:
        typer.echo(
            f"{to}: sent {counts['sent']} new, updated {counts['updated']}, replaced {counts['replaced']}, "
            f"unchanged {counts['unchanged']}"
        )
    if sent:
        typer.echo(f"  {sent['files']} files, {sent['bytes']} bytes in {sent['seconds']} s ({sent['mib_per_s']} MiB/s)")
    check = result.get("check") or {}
    typer.echo(f"remote verified: {check.get('verified')} of {check.get('expected')} files")
    typer.echo(f"upload report  {result['upload_report']}")


def rerun(
    run_id: Annotated[str, typer.Argument(help="the flow run whose failures to redo")],
    failed_only: Annotated[
        bool, Opt("--failed-only", help="only the samples and shards that failed in RUN_ID")
    ] = False,
    dry_run: Annotated[bool, Opt("--dry-run", help="print what would be rerun")] = False,
) -> None:
    """A new build run with RUN_ID's spec over only what failed in RUN_ID (from its ledger rows and report)."""
    if not failed_only:
        _fail("only `rerun RUN_ID --failed-only` exists: to run everything again, `latentforge build` resumes")
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415

    from flows.rerun import plan_rerun, start_deployment_rerun  # noqa: PLC0415

    try:
        rerun = plan_rerun(run_id)
    except ObjectNotFound:
        _fail(f"cannot rerun {run_id}: no such flow run on this Prefect API")
    except (ValueError, OSError, RuntimeError) as exc:  # a bad id, an unreachable API, a non-build run
        _fail(f"cannot rerun {run_id}: {exc}")
    typer.echo(f"{len(rerun.selectors)} failed in {run_id}: {json.dumps(rerun.selectors[:20])}")
    if not rerun.selectors:
        typer.echo("nothing to rerun")
        return
    if dry_run:
        return
    if rerun.deployment_id:
        typer.echo(f"started {start_deployment_rerun(rerun)} on deployment {rerun.deployment_id}")
        return
    from flows.run import run_build  # noqa: PLC0415

    ok, result = run_build(rerun.config)
    if not ok:
        _fail(str(result), code=1)
    typer.echo(
        f"rerun done: {result['encoded']} encoded, {result['failed']} still failed; run report {result['run_report']}"
    )
