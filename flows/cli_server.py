"""`latentforge server start|stop|status`: a Prefect server, the work pool and a worker on this host."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.cli_options import cli_errors
from infra.errors import ConfigError, NoServerError
from infra.ops import server
from infra.ops.automations import install_automations

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # literal brackets in help ([$PREFECT_HOME]) are text, not markup
    help="A Prefect server, work pool and worker here.",
)
Opt = typer.Option
HomeOpt = Annotated[
    Path | None,
    Opt("--home", help="Prefect home (database, settings) [$PREFECT_HOME]; state and logs in HOME/latentforge-server"),
]
AUTOMATIONS = Path(__file__).resolve().parents[1] / "infra" / "deploy" / "automations.yaml"


def _urls(state: server.ServerState) -> None:
    typer.echo(f"UI      {state.ui_url}")
    typer.echo(f"export PREFECT_API_URL={state.api_url}")


@app.command()
@cli_errors
def start(
    host: Annotated[str, Opt(help="address to listen on (0.0.0.0: every interface)")] = "127.0.0.1",
    port: Annotated[int, Opt(help="API and UI port")] = 4200,
    pool: Annotated[str, Opt(help="process work pool the worker polls (created if missing)")] = "latentforge",
    home: HomeOpt = None,
    timeout: Annotated[float, Opt(help="seconds to wait for the API and the worker")] = 120.0,
    ui_api_url: Annotated[
        str | None, Opt(help="API URL the UI calls from the browser [this server's; on 0.0.0.0: 127.0.0.1]")
    ] = None,
) -> None:
    """Start `prefect server` and a worker on POOL, detached; record their PIDs; print the URLs."""
    resolved = server.resolve_home(home)
    state = server.start(host=host, port=port, pool=pool, home=resolved, timeout=timeout, ui_api_url=ui_api_url)
    typer.echo(f"server  pid {state.server.pid}  {state.api_url}  (log {state.server.log})")
    typer.echo(f"worker  pid {state.worker.pid}  pool {state.pool}  (log {state.worker.log})")
    _urls(state)


@app.command()
@cli_errors
def status(home: HomeOpt = None) -> None:
    """Running or stopped, per process, and whether the API answers. Exit 0 only when all is running.

    A state file whose processes are all gone is stale: reported and removed."""
    resolved = server.resolve_home(home)
    report = server.status(resolved)
    if report is None:
        typer.echo(f"stopped (no server recorded in {server.state_dir(resolved)})")
        raise typer.Exit(1)
    state = report.state
    health = "healthy" if report.healthy else "not answering"
    typer.echo(f"server  {_word(report.server_running)}  pid {state.server.pid}  {state.api_url} ({health})")
    typer.echo(f"worker  {_word(report.worker_running)}  pid {state.worker.pid}  pool {state.pool}")
    if report.stale:
        server.remove_state(resolved)
        typer.echo(f"stale state file removed (started {state.started_at}; both processes are gone)")
        raise typer.Exit(1)
    _urls(state)
    raise typer.Exit(0 if report.running else 1)


def _word(running: bool) -> str:
    return "running" if running else "stopped"


@app.command()
@cli_errors
def stop(
    home: HomeOpt = None,
    timeout: Annotated[float, Opt(help="seconds after SIGTERM before SIGKILL")] = 20.0,
) -> None:
    """Stop the worker and the server by their recorded process groups (SIGTERM, then SIGKILL)."""
    resolved = server.resolve_home(home)
    state = server.stop(resolved, timeout=timeout)
    if state is None:
        typer.echo(f"nothing to stop (no server recorded in {server.state_dir(resolved)})")
        return
    typer.echo(f"stopped worker (pid {state.worker.pid}) and server (pid {state.server.pid})")


@app.command()
@cli_errors
def automations(
    block: Annotated[str, Opt(help="notification block TYPE-SLUG/NAME, e.g. custom-webhook/latentforge-alerts")],
    file: Annotated[Path, Opt(help="automations YAML")] = AUTOMATIONS,
    api_url: Annotated[str | None, Opt(help="[the recorded server's, else $PREFECT_API_URL]")] = None,
    home: HomeOpt = None,
) -> None:
    """Create the server-side automations (failure/crash alerts, heartbeat crash detection), block id filled in."""
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415 - heavy: Prefect, this command only

    recorded = server.read_state(server.state_dir(server.resolve_home(home)))
    url = api_url or (recorded.api_url if recorded else None) or os.environ.get("PREFECT_API_URL")
    if not url:
        raise NoServerError(
            "no server: start one (`latentforge server start`), or pass --api-url / set PREFECT_API_URL"
        )
    try:
        created = install_automations(url, block, file)
    except ObjectNotFound as exc:
        raise ConfigError(f"no block {block!r} on {url}: create it first (see infra/deploy/README.md)") from exc
    for name, automation_id in created:
        typer.echo(f"automation {name!r}  {automation_id}")
