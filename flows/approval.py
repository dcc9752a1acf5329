"""Hard-stop approvals: a person decides, or nothing is overwritten or deleted.

On a Prefect server of the user's (``PREFECT_API_URL``) the flow run pauses until a person answers (Prefect UI,
`latentforge approve`, API); the decision field is required (a bare "Resume" without a choice is refused by the
server), and a timeout is abort. On a terminal run's embedded server nobody else can reach the run, so it never
pauses there: the person at the terminal is asked (stdin a TTY), else the run aborts at once, naming the flag
that decides unattended. A stop signal while waiting ends the run at once (`infra.ops.preempt.waiting`).
"""

from __future__ import annotations

import getpass
import sys
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import click
from prefect import get_run_logger
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.settings import get_current_settings
from pydantic import Field, WithJsonSchema

from flows.alerting import alert_paused
from infra.gates.conflicts import ConflictChoice
from infra.gates.decision import Decision
from infra.ops import ephemeral, preempt

#: How often a paused run checks for an answer (seconds).
POLL_SECONDS = 2


def _decision(choices: type[StrEnum], description: str) -> WithJsonSchema:
    """An answer's choice as the UI's form shows it: labelled "Decision" with what each choice does, its options the
    choices' values (inline: a ``$ref`` to the enum made the V2 form label the field with the enum's class name)."""
    return WithJsonSchema(
        {"type": "string", "enum": [c.value for c in choices], "title": "Decision", "description": description}
    )


def _note() -> Any:
    """An answer's free-text why, titled for the UI's form (a field's title is its label there)."""
    return Field("", title="Note", description="Why: recorded in the run report and the card")


def _by() -> Any:
    """Who answered, titled for the UI's form."""
    return Field("", title="Decided by", description="Your name: recorded in the run report and the card")


class ConflictAnswer(RunInput):
    """OUT holds something else: reuse its spec, write OUT-vN, overwrite (replace sample by sample), or abort."""

    choice: Annotated[
        ConflictChoice,
        _decision(
            ConflictChoice,
            "reuse: adopt the existing spec and resume; "
            "new_dir: write OUT-vN; overwrite: replace samples one by one; abort: stop, nothing written",
        ),
    ]
    note: str = _note()
    by: str = _by()


class LossChoice(StrEnum):
    """Reconciliation found missing samples: accept the loss (recorded) or abort."""

    accept_loss = "accept_loss"
    abort = "abort"


class LossAnswer(RunInput):
    """Samples are missing from the cache: accept the loss (recorded with who and why) or abort."""

    choice: Annotated[
        LossChoice,
        _decision(
            LossChoice,
            "accept_loss: finish without the missing samples (recorded with who and why); abort: stop the run",
        ),
    ]
    note: str = _note()
    by: str = _by()


class StaleChoice(StrEnum):
    """Done samples' sources changed since they were encoded: re-encode exactly those, keep them (recorded), or
    abort."""

    replace_stale = "replace_stale"
    keep = "keep"
    abort = "abort"


class StaleAnswer(RunInput):
    """Samples changed in the source since they were encoded: replace exactly those, keep them, or abort."""

    choice: Annotated[
        StaleChoice,
        _decision(
            StaleChoice,
            "replace_stale: re-encode exactly the changed samples; "
            "keep: keep them as they are (recorded); abort: stop the run",
        ),
    ]
    note: str = _note()
    by: str = _by()


class ReplaceChoice(StrEnum):
    """Remote files differ from this cache's: replace exactly those (recorded) or abort."""

    replace = "replace"
    abort = "abort"


class ReplaceAnswer(RunInput):
    """Remote files at the upload target differ from this cache's: replace exactly those, or abort."""

    choice: Annotated[
        ReplaceChoice,
        _decision(
            ReplaceChoice, "replace: replace exactly the differing remote files (recorded); abort: stop the upload"
        ),
    ]
    note: str = _note()
    by: str = _by()


C = TypeVar("C", bound=StrEnum)


def decide(
    gate: str,
    answer_model: type[RunInput],
    choices: type[C],
    preview: str,
    timeout: int,
    *,
    unattended: str,
    **details: Any,
) -> Decision:
    """A person's answer at `gate` (its `choice` one of `choices`, each of which has ``abort``): the recorded
    Decision (with `details`). On the user's Prefect server the run pauses for `answer_model` (an
    approval-needed alert goes out first; a timeout is abort); on the embedded server the terminal is asked, or,
    with no terminal, the answer is abort. `unattended` names the flags that answer the gate without a person."""
    if ephemeral.is_embedded(get_current_settings().api.url):
        return _at_terminal(gate, choices, preview, unattended, details)
    logger = get_run_logger()
    logger.warning(
        "waiting for a person (up to %d s): answer in the Prefect UI or `latentforge approve` (unattended: %s)",
        timeout,
        unattended,
    )
    headline = next((line.lstrip("# ").strip() for line in preview.splitlines() if line.strip()), "")
    alert_paused(gate, headline)
    try:
        with preempt.waiting():
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


def _at_terminal(gate: str, choices: type[C], preview: str, unattended: str, details: dict[str, Any]) -> Decision:
    """Ask the person at the terminal (the preview, then the choices); abort at once when stdin is no terminal."""
    if not sys.stdin.isatty():
        by = "nobody to ask (no Prefect server, stdin not a terminal)"
        get_run_logger().error("%s: %s; what answers it unattended: %s", gate, by, unattended)
        return Decision(gate=gate, choice="abort", how="default", by=by, details=details)
    names = [choice.value for choice in choices]
    with preempt.waiting():
        click.echo(f"\n{preview.rstrip()}\n", err=True)
        choice = click.prompt(f"{gate}: your choice", type=click.Choice(names), err=True)
        note = click.prompt("note (recorded; Enter for none)", default="", show_default=False, err=True)
    by = f"{getpass.getuser()} (at the terminal)"
    return Decision(gate=gate, choice=choice, how="person", by=by, note=note, details=details)
