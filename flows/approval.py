"""Hard-stop approvals: the flow run pauses until a person answers (Prefect UI, `latentforge approve`, API).

The decision field is required: a bare "Resume" without a choice is refused by the server, and a
timeout is abort. Nothing is overwritten or deleted on a default, a timeout or a schedule.
"""

from __future__ import annotations

from enum import StrEnum

from prefect import get_run_logger
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput

from flows.alerting import alert_paused
from infra.conflicts import Decision

#: How often a paused run checks for an answer (seconds).
POLL_SECONDS = 2


class ConflictAnswer(RunInput):
    """OUT holds something else: reuse its spec, write OUT-vN, overwrite (replace sample by sample), or abort."""

    choice: Decision
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


class ReplaceChoice(StrEnum):
    """Remote files differ from this cache's: replace exactly those (recorded) or abort."""

    replace = "replace"
    abort = "abort"


class ReplaceAnswer(RunInput):
    """Remote files at the upload target differ from this cache's: replace exactly those, or abort."""

    choice: ReplaceChoice
    note: str = ""
    by: str = ""


#: The gate each answer model belongs to (named in approval-needed alerts).
GATES = {"ConflictAnswer": "conflict", "LossAnswer": "loss", "ReplaceAnswer": "upload-replace"}


def ask(answer_model: type[RunInput], preview_markdown: str, timeout: int) -> RunInput | None:
    """Pause this flow run for a typed answer; None when nobody answered in time."""
    logger = get_run_logger()
    logger.warning("waiting for a person (up to %d s): answer in the Prefect UI or `latentforge approve`", timeout)
    headline = next((line.lstrip("# ").strip() for line in preview_markdown.splitlines() if line.strip()), "")
    alert_paused(GATES.get(answer_model.__name__, answer_model.__name__), headline)
    try:
        return pause_flow_run(
            wait_for_input=answer_model.with_initial_data(description=preview_markdown),
            timeout=timeout,
            poll_interval=POLL_SECONDS,
        )
    except FlowPauseTimeout:
        logger.error("no answer within %d s: treated as abort", timeout)
        return None


def ask_conflict(preview_markdown: str, timeout: int) -> tuple[Decision, str]:
    """The conflict gate: (decision, note). A timeout is abort."""
    answer = ask(ConflictAnswer, preview_markdown, timeout)
    if answer is None:
        return Decision.abort, f"no answer within {timeout} s"
    return Decision(answer.choice), _who(answer)


def ask_loss(preview_markdown: str, timeout: int) -> tuple[LossChoice, str]:
    """The loss gate: (decision, who and why). A timeout is abort."""
    answer = ask(LossAnswer, preview_markdown, timeout)
    if answer is None:
        return LossChoice.abort, f"no answer within {timeout} s"
    return LossChoice(answer.choice), _who(answer)


def ask_replace(preview_markdown: str, timeout: int) -> tuple[ReplaceChoice, str]:
    """The remote-conflict gate of the upload: (decision, who and why). A timeout is abort."""
    answer = ask(ReplaceAnswer, preview_markdown, timeout)
    if answer is None:
        return ReplaceChoice.abort, f"no answer within {timeout} s"
    return ReplaceChoice(answer.choice), _who(answer)


def _who(answer: RunInput) -> str:
    by, note = getattr(answer, "by", ""), getattr(answer, "note", "")
    return f"answered by {by or 'someone (no name given)'} in the Prefect run input" + (f": {note}" if note else "")
