"""Samples in progress when a run died: tried again once, alone, then recorded failed (DESIGN, invariant 9).

Before a sample's bytes are read (on the shard loop's thread, for the read-ahead too) the shard's journal gets a mark
(`infra.cache.ledger.Journal.mark`); the sample's row follows it when the sample ends. A mark with no row after it
means the process died with that sample in progress: an out-of-memory kill, a decoder that took the process down,
or a plain SIGKILL (a spot instance gone, which says nothing about the sample). So the next run tries such a sample
again once, alone: it is not read ahead, so when its turn comes no other sample is read or decoded. A sample in
progress when two runs died is recorded ``failed`` / ``killed_run`` and not tried again; ``--only`` naming it
(``latentforge rerun RUN_ID --failed-only``) tries it again on purpose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from infra.cache.ledger import LedgerRow, Marks
from infra.preprocess.resume import selected
from infra.sources import SampleRef

logger = logging.getLogger(__name__)

KILLED_RUN = "killed_run"
#: Runs that died with a sample in progress before it is recorded failed rather than tried again.
DEATHS = 2


@dataclass(frozen=True)
class InFlight:
    """A shard's samples left in progress by runs that died: their marks with no row after them, by key."""

    marks: Marks = field(default_factory=dict)
    keys: frozenset[str] | None = None  # ``--only``'s keys of the shard: what the user asked to be tried again

    def suspect(self, key: str) -> bool:
        """In progress when a run died: tried alone (never read ahead)."""
        return key in self.marks

    def killed(self, ref: SampleRef | str, previous: LedgerRow | None) -> bool:
        """Not to be tried again (`ref`, or its key): in progress at `DEATHS` deaths, or recorded so by an earlier
        run, and not named by ``--only``."""
        key = ref if isinstance(ref, str) else ref.key
        if self.keys is not None and selected(key, self.keys):
            return False
        recorded = previous is not None and previous.status == "failed" and previous.reason == KILLED_RUN
        return recorded or len(self.marks.get(key, ())) >= DEATHS

    def detail(self, key: str, run_id: str | None) -> str:
        """Why the sample is failed, with how to try it again."""
        marks = self.marks.get(key, [])
        pids = ", ".join(str(m.get("pid")) for m in marks)
        alone = " (the last time alone: no other sample in flight)" if marks and marks[-1].get("alone") else ""
        again = f"latentforge rerun {run_id} --failed-only" if run_id else "latentforge rerun RUN_ID --failed-only"
        return (
            f"in progress when {len(marks)} runs died (processes {pids}){alone}: an out-of-memory kill, a decoder "
            f"crash or a SIGKILL; not tried again. To try it again: {again}, or --only SHARD/KEY"
        )

    def say(self, shard_id: str) -> None:
        """Log what this shard task will do with the samples left in progress."""
        if not self.marks:
            return
        twice = sorted(k for k, m in self.marks.items() if len(m) >= DEATHS)
        once = len(self.marks) - len(twice)
        if once:
            again = "each is tried again once, alone"
            logger.warning("shard %s: %d sample(s) were in progress when a run died: %s", shard_id, once, again)
        for key in twice:
            logger.warning(
                "shard %s: %s was in progress when %d runs died: recorded failed (%s), not tried again; to try it "
                "again: latentforge rerun RUN_ID --failed-only",
                shard_id,
                key,
                len(self.marks[key]),
                KILLED_RUN,
            )
