"""A gate's decision, as it is recorded: which gate, what was chosen, how, by whom, why, and when.

Every gate that stops a run for a person records one (conflict, loss, upload replace): in the run report, the
upload report, the artifacts and the card. ``how`` says where the answer came from: a person (the Prefect form,
`latentforge approve`, the terminal's prompt), a token bound to the change (``--approve-overwrite``/
``--approve-replace``), a standing policy (``--on-conflict new_dir``, ``--on-loss accept``), a timeout, or nobody to
ask (a terminal run without a terminal: the default), both always abort; or ``resumed``: an approved overwrite an
interrupted run began, which the next run of the same spec goes on with (cache.json records it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

How = Literal["person", "token", "policy", "timeout", "default", "resumed"]


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


class Decision(BaseModel):
    """One answer at one gate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gate: str = Field(description="conflict, loss, upload-replace, ...")
    choice: str
    how: How
    by: str = Field(description="who answered (a person's name), or which token or setting decided")
    note: str = ""
    at: str = Field(default_factory=utc_now)
    details: dict[str, Any] = Field(default_factory=dict, description="what was decided about (counts, paths)")

    def text(self) -> str:
        """``overwrite by data-lead (a person): keep last week's cache``, ``abort: no answer within 60 s``: the choice,
        then who or what made it, never a bare word in brackets that could be read as the choice's own default."""
        return HOW_TEXT[self.how].format(choice=self.choice, by=self.by or "someone (no name given)") + (
            f": {self.note}" if self.note else ""
        )


#: How each kind of answer reads after the choice.
HOW_TEXT: dict[str, str] = {
    "person": "{choice} by {by} (a person)",
    "token": "{choice} by {by} (a token bound to this change)",
    "policy": "{choice} by the setting {by}",
    "timeout": "{choice}: {by}",
    "default": "{choice}: {by}",
    "resumed": "{choice}, resumed: {by}",
}
