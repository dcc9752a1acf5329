"""The plan's samples a shard task did not visit: each gets its row with the reason, so the ledger holds one row per
planned sample (DESIGN, invariant 8), and the plan is recorded in OUT before the first shard runs.

A shard task lists its shard again when it opens it; what the run planned is the listing recorded at the run's
start (`infra.cache.listing`). When the task ends, a planned sample without a row is one the shard no longer let it
read: ``skipped`` ``shard_vanished`` / ``shard_changed`` (the file is gone, or is not the file that was listed) or
``shard_truncated`` (the shard now ends before it); or one a crash of the task left: ``failed`` ``shard_crashed``.
A task stopped on purpose (SIGTERM, Ctrl-C, a full or read-only OUT) writes none: the same command resumes there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from infra.cache import ledger, listing
from infra.cache.ledger import LedgerRow, windows_by_clip
from infra.errors import InputError, LedgerError
from infra.job import Job
from infra.plan import ShardPlan, recorded_shards
from infra.preprocess.chunks import Chunk
from infra.preprocess.resume import selected
from infra.sources.vbvr import check_unchanged

logger = logging.getLogger(__name__)

SHARD_CRASHED = "shard_crashed"


def unvisited(
    job: Job, shard: ShardPlan, chunk: Chunk | None, rows: dict[str, LedgerRow], keys: frozenset[str] | None
) -> Iterator[tuple[str, str, str]]:
    """(key, id, group) of the planned samples of this task (its chunk, ``--only``'s keys) that have no row in
    `rows` (a clip's windows count as its rows); nothing when the plan was not recorded."""
    planned = listing.read_listing(job.out, shard.id)
    if planned is None:
        return
    first, stop = (0, shard.quota) if chunk is None else (chunk.start, chunk.stop)
    windowed = windows_by_clip(rows)
    for key, sid, group in planned[first:stop]:
        if key not in rows and key not in windowed and (keys is None or selected(key, keys)):
            yield key, sid, group


def unvisited_rows(
    job: Job,
    shard: ShardPlan,
    chunk: Chunk | None,
    rows: dict[str, LedgerRow],
    keys: frozenset[str] | None,
    *,
    read_error: Exception | None = None,
    crash: BaseException | None = None,
) -> list[LedgerRow]:
    """A row for each planned sample the task did not visit: failed ``shard_crashed`` after a `crash`, else skipped
    with why the shard did not yield it (`read_error`: the shard's own, where its reading stopped)."""
    if crash is not None:
        status, reason = "failed", SHARD_CRASHED
        detail = f"the shard task crashed before this sample ({type(crash).__name__}: {crash})"
    else:
        status, (reason, detail) = "skipped", _why_unread(shard, read_error)
    made = [
        LedgerRow(key=key, id=sid, group=group, shard=shard.id, status=status, reason=reason, detail=detail)
        for key, sid, group in unvisited(job, shard, chunk, rows, keys)
    ]
    if made:
        logger.warning("shard %s: %d planned sample(s) not visited: %s (%s)", shard.id, len(made), reason, detail)
    return made


def _why_unread(shard: ShardPlan, read_error: Exception | None) -> tuple[str, str]:
    """(reason, detail) for a planned sample the shard's listing no longer gave."""
    try:
        check_unchanged(shard.shard)  # gone, or not the file that was listed (its size or mtime)
    except InputError as exc:
        return exc.reason, exc.detail
    if read_error is not None:
        return "shard_truncated", f"planned, but the shard cannot be read as far as it now: {read_error}"
    return "shard_changed", f"planned, but {shard.path} no longer lists it"


def record_plan(job: Job, shards: list[ShardPlan], spool: Path | None) -> list[ShardPlan]:
    """Record the plan's listing (`shards`, their samples listed into `spool`) in OUT (under the writer lock, before
    any shard runs); returns the plan's shards with those an earlier run planned that the source no longer has and
    that still hold planned samples without a row (a shard that vanished between a killed run and its resume): their
    tasks write those rows. Nothing is recorded for a plan that spooled nothing (`spool` None)."""
    if spool is None:
        return shards
    carried = _carried(job, shards)
    shards = [*shards, *carried]
    listing.install(job.out, spool, [s.model_dump(mode="json") for s in shards])
    if carried:
        logger.warning(
            "%d shard(s) an earlier run planned are gone from the source with samples unaccounted for: %s",
            len(carried),
            ", ".join(s.id for s in carried),
        )
    return shards


def _carried(job: Job, shards: list[ShardPlan]) -> list[ShardPlan]:
    """The recorded plan's shards this plan (`shards`) lacks although its selection takes every shard it has, whose
    planned samples are not all in their ledger."""
    selection = job.selection
    if selection.limit is not None or selection.only is not None:
        return []  # a narrower run: a shard it lacks was not selected, not lost
    planned = {s.id for s in shards}
    carried = []
    try:  # each checked: inside the source, a shard plan (`recorded_shards`)
        recorded = recorded_shards(job.out, job.source, job.spec.follow_symlinks) or []
    except LedgerError as exc:
        logger.warning("%s: this run records the plan anew", exc)
        return []
    for shard in recorded:
        if shard.id in planned or (selection.shard_filter and selection.shard_filter not in shard.id):
            continue
        if next(unvisited(job, shard, None, ledger.read_shard(job.out, shard.id), None), None) is not None:
            carried.append(shard)
    return carried
