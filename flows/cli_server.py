"""`latentforge server start|stop|status`: a Prefect server, the work pool and a worker on this host."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A Prefect server, work pool and worker here.")
