"""`latentforge upload`: registered on the main app in flows/cli.py.

`upload`'s options are UploadConfig's fields (the ``upload:`` section of a config file), flags on top.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli_options import OutArg, config_command
from flows.preflight import check_cache, check_store_settings
from flows.settings import check_upload
from infra.config import UploadConfig, load_config_file
from infra.errors import ConfigError

Opt = typer.Option


@config_command(UploadConfig.model_fields)
def upload(
    out: OutArg,
    verify_only: Annotated[
        bool, Opt("--verify-only", help="send nothing; check the remote against the ledger")
    ] = False,
    approval_timeout: Annotated[int, Opt(help="seconds a replace approval waits; then abort")] = 86400,
    *,
    config_file: Path | None,
    flags: dict[str, Any],
) -> None:
    """Publish a finished cache (after its gates passed), resumably; verify the remote against the ledger.

    Settings come from the config file's ``upload:`` section, flags on top. Exit 0 when the remote holds
    exactly the cache, 1 when a gate, a conflict or the check failed."""
    section = (load_config_file(config_file) if config_file else {}).get("upload") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{config_file}: `upload` is a section of keys, not {section!r}")
    config = check_upload(UploadConfig.model_validate({**section, **flags}))
    check_store_settings(config.to, str(out))
    check_cache(out)  # a mistake is one line, exit 2, before any flow starts
    from flows.terminal_run import run_or_raise  # noqa: PLC0415 - heavy: torch, Prefect
    from flows.upload import upload_cache  # noqa: PLC0415

    result = run_or_raise(
        upload_cache, out=str(out), upload=config, verify_only=verify_only, approval_timeout=approval_timeout
    )
    counts, sent = result.get("counts"), result.get("sent")
    if counts:
        typer.echo(
            f"{config.to}: sent {counts['sent']} new, updated {counts['updated']}, replaced {counts['replaced']}, "
            f"unchanged {counts['unchanged']}"
        )
    if sent:
        typer.echo(f"  {sent['files']} files, {sent['bytes']} bytes in {sent['seconds']} s ({sent['mib_per_s']} MiB/s)")
    check = result.get("check") or {}
    typer.echo(f"remote verified: {check.get('verified')} of {check.get('expected')} files")
    typer.echo(f"upload report  {result['upload_report']}")
