"""Hard-stop approvals: the flow run pauses until a person answers (Prefect UI, `latentforge approve`, API).

The decision field is required: a bare "Resume" without a choice is refused by the server, and a
timeout is abort. Nothing is overwritten or deleted on a default, a timeout or a schedule.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar

from prefect import get_run_logger
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput

from flows.alerting import alert_paused
from infra.gates.conflicts import ConflictChoice
from infra.gates.decision import Decision

#: How often a paused run checks for an answer (seconds).
POLL_SECONDS = 2


class ConflictAnswer(RunInput):
    """OUT holds something else: reuse its spec, write OUT-vN, overwrite (replace sample by sample), or abort."""

    choice: ConflictChoice
    note: str = ""
    by: str = ""


class LossChoice(StrEnum):
    """Reconciliation found missing samples: accept the loss (recorded) or abort."""

    accept_loss = "accept_loss"
    abort = "abort"


class LossAnswer(RunInput):
    """Samples are missing from the cache: accept the loss (recorded with who and why) or abort."""

    choice: LossChoice
    note: str = ""
    by: str = ""


class StaleChoice(StrEnum):
    """Done samples' sources changed since they were encoded: re-encode exactly those, keep them (recorded), or
    abort."""

    replace_stale = "replace_stale"
    keep = "keep"
    abort = "abort"


class StaleAnswer(RunInput):
    """Samples changed in the source since they were encoded: replace exactly those, keep them, or abort."""

    choice: StaleChoice
    note: str = ""
    by: str = ""


class ReplaceChoice(StrEnum):
    """Remote files differ from this cache's: replace exactly those (recorded) or abort."""

    replace = "replace"
    abort = "abort"


class ReplaceAnswer(RunInput):
    """Remote files at the upload target differ from this cache's: replace exactly those, or abort."""

    choice: ReplaceChoice
    note: str = ""
    by: str = ""


C = TypeVar("C", bound=StrEnum)


def decide(
    gate: str, answer_model: type[RunInput], choices: type[C], preview: str, timeout: int, **details: Any
) -> Decision:
    """Pause this flow run at `gate` until a person answers `answer_model` (its `choice` one of `choices`, each
    of which has ``abort``): the recorded Decision (with `details`). An approval-needed alert goes out first;
    a timeout is abort."""
    logger = get_run_logger()
    logger.warning("waiting for a person (up to %d s): answer in the Prefect UI or `latentforge approve`", timeout)
    headline = next((line.lstrip("# ").strip() for line in preview.splitlines() if line.strip()), "")
    alert_paused(gate, headline)
    try:
        answer = pause_flow_run(
            wait_for_input=answer_model.with_initial_data(description=preview),
            timeout=timeout,
            poll_interval=POLL_SECONDS,
        )
    except FlowPauseTimeout:
        logger.error("no answer within %d s: treated as abort", timeout)
        return Decision(gate=gate, choice="abort", how="timeout", by=f"no answer within {timeout} s", details=details)
    choice = choices(answer.choice).value
    by, note = getattr(answer, "by", ""), getattr(answer, "note", "")
    return Decision(
        gate=gate, choice=choice, how="person", by=by or "someone (no name given)", note=note, details=details
    )
