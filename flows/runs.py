"""Paused runs on a Prefect server: list them with their previews, answer them from any process.

Prefect 3.9 has no CLI to resume a run with input; these are the two calls `latentforge pending` and
`latentforge approve` make. The server validates the answer against the paused run's schema: a
bad choice is refused and the run stays paused.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.flow_runs import resume_flow_run
from prefect.input.run_input import keyset_from_paused_state, read_flow_run_input
from prefect.settings import get_current_settings

from infra.errors import ConfigError, NoServerError


class ApprovalRefused(ConfigError):
    """The server refused the answer (a choice the paused run does not offer, a run that is not paused)."""


@dataclass(frozen=True)
class PendingRun:
    """A paused flow run waiting for a person."""

    id: str
    name: str
    paused_since: str
    preview: str


def require_server() -> str:
    """The configured API URL, or a clear error (the embedded ephemeral API lives inside one process)."""
    url = get_current_settings().api.url
    if not url:
        raise NoServerError(
            "no Prefect server configured: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api). "
            "A run on the embedded ephemeral API cannot be answered from another process."
        )
    return url


def pending_runs() -> list[PendingRun]:
    """Every paused flow run, oldest first, with the markdown preview it was paused with."""
    require_server()
    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=paused)
    pending = []
    for run in sorted(runs, key=lambda r: r.state.timestamp if r.state else 0):
        preview = ""
        try:
            preview = read_flow_run_input(keyset_from_paused_state(run.state)["description"], run.id) or ""
        except (RuntimeError, ValueError):
            preview = "(no preview)"
        pending.append(PendingRun(str(run.id), run.name, str(run.state.timestamp), str(preview)))
    return pending


def approve(run_id: str, choice: str, note: str = "", by: str = "") -> None:
    """Resume a paused run with {choice, note, by}; raises RuntimeError when the server refuses the answer."""
    require_server()
    try:
        resume_flow_run(UUID(run_id), run_input={"choice": choice, "note": note, "by": by})
    except (RuntimeError, ValueError) as exc:  # the server's REJECT, a malformed id
        raise ApprovalRefused(f"not resumed: {exc}") from exc
