"""Samples in flight when a run died: suspects, decoded alone in a child; recorded failed only on proof (DESIGN,
invariant 9).

Before a sample's bytes are read (on the shard loop's thread, for the read-ahead too) the shard's journal gets a mark
(`infra.cache.ledger.Journal.mark`); the sample's row follows it when the sample ends. A mark with no row after it means
the process died with that sample in flight: a decoder that took the process down, an out-of-memory kill, or a plain
SIGKILL from outside (a spot instance gone, an operator, the OOM killer acting for another process), which says nothing
about the sample. So a mark blames nobody: the sample is a *suspect*. The next run tries it alone: it is not read ahead,
and its decode and prepare run in a child process of its own (`infra.preprocess.alone`), the parent encoding what the
child hands back (the same bytes as in the parent; about 2.4 CPU-s more a suspect, the child's start). Only that child
dying on it, twice in a row within the run (a fresh child right after the first; a child that dies before it says it is
ready counts for nothing), is proof: the sample is recorded ``failed`` / ``killed_run`` with the children's signals in
its row (``extra`` ``killed_child``, and the detail), and the same command does not try it again; ``--only`` naming it
(``latentforge rerun RUN_ID --failed-only``) tries it again on purpose, alone in a child again. A run killed while a
suspect's child works blames nobody either: its mark stays, and the sample is a suspect again.

A ``killed_run`` row without that proof (written before latentforge decoded suspects in a child, when two deaths of
the whole process with the sample in flight were taken as proof) is a suspect too: the same command tries it again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from infra.cache.ledger import LedgerRow, Marks
from infra.preprocess.resume import selected

logger = logging.getLogger(__name__)

KILLED_RUN = "killed_run"
#: A ``killed_run`` row's proof, in its ``extra``: the deaths of the children that decoded the sample alone
#: (`infra.preprocess.alone.ChildKilled.evidence`).
PROOF = "killed_child"


def proven(row: LedgerRow | None) -> bool:
    """Whether `row` records a sample that killed the children decoding it alone (`PROOF`)."""
    return (
        row is not None
        and row.status == "failed"
        and row.reason == KILLED_RUN
        and isinstance(row.extra.get(PROOF), dict)
    )


@dataclass(frozen=True)
class InFlight:
    """A shard's samples left in flight by runs that died (their marks with no row after them, by key), and what the
    build does with them and with its ``killed_run`` rows."""

    marks: Marks = field(default_factory=dict)
    keys: frozenset[str] | None = None  # ``--only``'s keys of the shard: what the user asked to be tried again

    def killed(self, ref_key: str, previous: LedgerRow | None) -> bool:
        """Not to be tried again: its row has the proof, and ``--only`` does not name it."""
        if self.keys is not None and selected(ref_key, self.keys):
            return False
        return proven(previous)

    def suspect(self, key: str, previous: LedgerRow | None) -> bool:
        """To be tried alone, its decode in a child: in flight when a run died, a ``killed_run`` row without proof, or
        one with proof that ``--only`` names."""
        if self.killed(key, previous):
            return False
        recorded = previous is not None and previous.status == "failed" and previous.reason == KILLED_RUN
        return key in self.marks or recorded

    def say(self, shard_id: str, previous: dict[str, LedgerRow]) -> None:
        """Log what this shard task will do with its suspects."""
        again = {k for k, row in previous.items() if self.suspect(k, row) and k not in self.marks}
        if self.marks:
            logger.warning(
                "shard %s: %d sample(s) were in flight when a run died: each is decoded alone in a child process",
                shard_id,
                len(self.marks),
            )
        if again:
            logger.warning(
                "shard %s: %d %s row(s) tried again (no child's death as proof, or named by --only): each is decoded "
                "alone in a child process",
                shard_id,
                len(again),
                KILLED_RUN,
            )


def blamed_detail(reason: str, run_id: str | None) -> str:
    """A proven ``killed_run`` row's detail: why (`reason`: the children's deaths), and how to try it again."""
    again = f"latentforge rerun {run_id} --failed-only" if run_id else "latentforge rerun RUN_ID --failed-only"
    return f"{reason}; not tried again by the same command. To try it again: {again}, or --only SHARD/KEY"
