"""Paused runs on a Prefect server: list them with their previews, answer them from any process.

Prefect 3.9 has no CLI to resume a run with input; these are the two calls `latentforge pending` and
`latentforge approve` make. The server validates the answer against the paused run's schema: a
bad choice is refused and the run stays paused.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.flow_runs import resume_flow_run
from prefect.input import read_flow_run_input
from prefect.settings import get_current_settings

from infra import outdir
from infra.cache.lock import LockOwner, recorded_owner
from infra.errors import ConfigError, NoServerError

#: Flow runs read per request while a short id is looked up.
PAGE = 200


class ApprovalRefused(ConfigError):
    """The server refused the answer (a choice the paused run does not offer, a run that is not paused)."""


@dataclass(frozen=True)
class PendingRun:
    """A paused flow run waiting for a person."""

    id: str
    name: str
    paused_since: str
    preview: str
    #: Why nobody can resume it any more (its process is gone, its pause expired); None while it waits.
    gone: str | None = None


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
    """Every paused flow run, oldest first, with the markdown preview it was paused with; a run that can no longer
    be resumed (its process killed while paused, its pause expired) carries why in `gone`."""
    require_server()
    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=paused)
    pending = []
    for run in sorted(runs, key=lambda r: r.state.timestamp if r.state else 0):
        keys = run.state.state_details.run_input_keyset  # the input keys the paused run stored (as Prefect's UI reads)
        try:
            preview = (read_flow_run_input(keys["description"], run.id) or "") if keys else ""  # no input asked
        except ValueError:
            preview = "(no preview)"
        pending.append(PendingRun(str(run.id), run.name, str(run.state.timestamp), str(preview), gone_why(run)))
    return pending


def gone_why(run: Any) -> str | None:
    """Why a paused run can no longer be resumed, or None: its pause expired, or the process that ran it (the
    worker's ``infrastructure_pid``, else the pid in OUT's writer-lock record, written by this run) is gone."""
    details = run.state.state_details if run.state else None
    if details is not None and details.pause_timeout is not None and details.pause_timeout < datetime.now(UTC):
        return f"its pause expired at {details.pause_timeout} (no answer is abort)"
    owner = _owner(run)
    if owner is not None and owner.host == socket.gethostname() and not owner.alive_here():
        return f"its process ({owner.text()}) is gone: run the command again to resume"
    return None


def _owner(run: Any) -> LockOwner | None:
    """The process that runs `run`, where it is known on this host: the worker's ``HOST:PID``, or the record in
    OUT's writer lock when it was written by this run (taken after the run started)."""
    pid = run.infrastructure_pid or ""
    host, _, number = pid.rpartition(":")
    if number.isdigit():
        return LockOwner(int(number), host or socket.gethostname(), None, "?")
    out = ((run.parameters or {}).get("config") or {}).get("out")
    if not out or run.start_time is None:
        return None
    try:
        owner = recorded_owner(outdir.root(out))  # read back bounded: None for a record that is not ours
        taken = datetime.fromisoformat(owner.since) if owner is not None else None
    except (OSError, ValueError, outdir.UnsafePath):  # no record (released, or never taken: a pause)
        return None
    if owner is None or taken is None:
        return None
    taken = taken if taken.tzinfo is not None else taken.replace(tzinfo=UTC)  # ours are UTC
    return owner if taken >= run.start_time.replace(microsecond=0) else None


def resolve_run_id(run_id: str, *, paused_only: bool = False) -> str:
    """A full flow run id from RUN_ID or a unique prefix of it (``ad486b57``; dashes optional); ConfigError when
    no run, or more than one, starts so."""
    try:
        return str(UUID(run_id))
    except ValueError:
        pass
    prefix = run_id.replace("-", "").lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise ConfigError(f"{run_id!r} is not a flow run id (hexadecimal, as `latentforge pending` prints them)")
    require_server()
    state = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])) if paused_only else None
    found: list[str] = []
    with get_client(sync_client=True) as client:
        offset = 0
        while page := client.read_flow_runs(flow_run_filter=FlowRunFilter(state=state), limit=PAGE, offset=offset):
            found += [str(r.id) for r in page if r.id.hex.startswith(prefix)]
            offset += len(page)
    which = "paused flow run" if paused_only else "flow run"
    if not found:
        raise ConfigError(f"no {which} id starts with {run_id!r}")
    if len(found) > 1:
        raise ConfigError(
            f"{run_id!r} is ambiguous: {len(found)} {which}s start so ({', '.join(found[:5])}); give more"
        )
    return found[0]


def approve(run_id: str, choice: str, note: str = "", by: str = "") -> str:
    """Resume a paused run (its id or a unique prefix) with {choice, note, by}; returns its full id.
    ApprovalRefused when the server refuses the answer."""
    require_server()
    run_id = resolve_run_id(run_id, paused_only=True)
    try:
        resume_flow_run(UUID(run_id), run_input={"choice": choice, "note": note, "by": by})
    except (RuntimeError, ValueError) as exc:  # the server's REJECT, a malformed id
        raise ApprovalRefused(f"not resumed: {exc}") from exc
    return run_id
