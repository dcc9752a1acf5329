"""Stale samples: done in the ledger, but their source changed since they were encoded (an upstream revision
of a prompt or a clip). They are never reused silently: verify-existing lists them and the run stops for a
decision (``replace_stale`` re-encodes exactly those, ``keep`` records that the cache knowingly holds them).

A sample's recorded source identity (its members' names, sizes and mtimes as listed, and the sha256 of the
bytes read) is compared with the current listing, which costs no read. When only mtimes differ (a re-packed
shard), the bytes are read and their sha256 compared: the same bytes are not stale.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from infra.cache import ledger
from infra.cache.ledger import LedgerRow
from infra.cache.listing import read_identities
from infra.errors import InputError
from infra.job import Job
from infra.plan import ShardPlan
from infra.sources import SampleRef, ShardReadError, open_source
from infra.sources.identity import SourceIdentity

logger = logging.getLogger(__name__)

#: same: unchanged; refreshed: only mtimes changed, the bytes are the same; kept: a `keep` decision covers this
#: change; unknown: the row records no source identity (made before latentforge recorded it); stale: changed.
SourceState = Literal["same", "refreshed", "kept", "unknown", "stale"]
KEPT = "stale_kept"  # ledger row extra: the listing a `keep` decision accepted


def listing(identity: SourceIdentity) -> dict[str, Any]:
    """The part of an identity a `keep` decision is bound to (members as listed)."""
    return {name: member.model_dump() for name, member in sorted(identity.members.items())}


def source_state(row: LedgerRow, ref: SampleRef) -> tuple[SourceState, dict[str, str]]:
    """How the sample `ref` (as listed now) stands against what its done `row` was made from."""
    if row.source is None:
        return "unknown", {}
    changed = row.source.differs_in(ref.identity)
    if not changed:
        return "same", {}
    if row.extra.get(KEPT) == listing(ref.identity):
        return "kept", changed
    if set(changed.values()) == {"mtime"} and all(name in row.source.read_sha256 for name in changed):
        try:
            ref.read_media(), ref.read_prompt()  # the readers note each member's sha256
        except InputError:
            return "stale", changed
        if all(ref.identity.read_sha256.get(name) == row.source.read_sha256[name] for name in changed):
            return "refreshed", {}
    return "stale", changed


def refreshed(row: LedgerRow, ref: SampleRef) -> LedgerRow:
    """The row with its members' listing brought up to date (same bytes, new mtimes)."""
    assert row.source is not None
    source = SourceIdentity(members=dict(ref.identity.members), read_sha256=dict(row.source.read_sha256))
    return row.model_copy(update={"source": source})


def kept(row: LedgerRow, ref: SampleRef) -> LedgerRow:
    """The row marked as knowingly kept for the source as listed now (a `keep` decision)."""
    return row.model_copy(update={"extra": {**row.extra, KEPT: listing(ref.identity)}})


@dataclass(frozen=True)
class StaleSample:
    """A done sample whose source changed since it was encoded."""

    shard: str
    key: str
    id: str
    group: str
    path: str | None
    changed: dict[str, str]

    @property
    def selector(self) -> str:
        """``SHARD/KEY``: what a decision names."""
        return f"{self.shard}/{self.key}"


@dataclass
class StaleReport:
    """The plan's done samples checked against the source as listed now."""

    stale: list[StaleSample] = field(default_factory=list)
    kept: int = 0  # covered by an earlier `keep` decision
    unknown: int = 0  # rows with no source identity (made before latentforge recorded it)
    refreshed: int = 0  # mtimes changed, bytes the same
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "selectors": [s.selector for s in self.stale]}


def _reusable(out_row: LedgerRow, job: Job) -> bool:
    return out_row.status == "done" and out_row.fingerprint == job.fingerprint and bool(out_row.path)


def find_stale(job: Job, shards: list[ShardPlan], spool: Path | None = None) -> StaleReport:
    """Every done sample of the plan's `shards` whose source changed: against the plan's listing where it spooled
    (into `spool`) what each sample was listed as (a build's resume: `infra.cache.listing.spool_identities`), else
    (or where a sample's bytes must be read: only its mtimes changed) a pass over the source's listing."""
    report = StaleReport()
    source = open_source(job.source, job.spec, job.limits)
    for shard in shards:
        try:
            rows = ledger.read_shard(job.out, shard.id)
        except (OSError, ValueError) as exc:
            report.problems.append(f"ledger of {shard.id} unreadable: {exc}")
            continue
        if not rows:
            continue
        listed = spooled(spool, shard)
        if listed is not None:
            found = StaleReport()
            try:
                _check(job, shard, listed, rows, found)
            except NeedsBytes:  # listed below, where the sample's bytes can be read
                pass
            else:
                report.stale += found.stale
                report.kept, report.unknown = report.kept + found.kept, report.unknown + found.unknown
                report.refreshed += found.refreshed
                continue
        try:
            with contextlib.closing(source.samples(shard.shard)) as samples:
                _check(job, shard, itertools.islice(samples, shard.quota), rows, report)
        except ShardReadError as exc:  # listed up to the damage; the shard's task reports it
            report.problems.append(str(exc))
    if report.stale:
        logger.warning("%d done sample(s) changed in the source since they were encoded", len(report.stale))
    return report


def _check(
    job: Job, shard: ShardPlan, refs: Iterable[SampleRef], rows: dict[str, LedgerRow], report: StaleReport
) -> None:
    """Each done row of `rows` against its sample in `refs` (the shard's samples as listed), into `report`."""
    by_clip = ledger.windows_by_clip(rows)
    for ref in refs:
        for row in [rows[ref.key]] if ref.key in rows else by_clip.get(ref.key, []):
            if not _reusable(row, job):
                continue
            state, changed = source_state(row, ref)  # a windows:K row: its clip's source
            if state == "stale":
                report.stale.append(StaleSample(shard.id, row.key, row.id, ref.group, row.path, changed))
            elif state in ("kept", "unknown", "refreshed"):
                setattr(report, state, getattr(report, state) + 1)


class NeedsBytes(Exception):
    """A spooled sample's bytes were asked for: the plan's listing holds what it was listed as, not its bytes."""


def _needs_bytes() -> bytes | None:
    raise NeedsBytes


def spooled(spool: Path | None, shard: ShardPlan) -> Iterator[SampleRef] | None:
    """The shard's samples as the plan listed them (up to its quota), where it spooled their identities and
    listed the shard without damage (a damaged one is listed again: its damage is a problem of the report); each a
    ref whose readers raise `NeedsBytes`. None: the source is listed."""
    if spool is None or shard.damage is not None:
        return None
    found = read_identities(spool, shard.id)
    if found is None:
        return None
    return (
        SampleRef(id=sid, group=group, key=key, read_media=_needs_bytes, read_prompt=_needs_bytes, identity=identity)
        for key, sid, group, identity in found
    )
