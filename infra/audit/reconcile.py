"""Count reconciliation (read only): expected = the plan, what was listed when the run began (DESIGN, invariant 8):
each planned shard's samples as the build recorded them in OUT (`infra.cache.listing`), its first `quota`; a shard
the plan did not record (a cache of an older latentforge, a plan made now for another selection) is listed from the
source now, and one not listable to its end counts what was listed, and is a shard problem. Produced = a done
ledger row of this fingerprint whose file for every output kind is on disk at the ledger's size. Every other
expected sample is listed with a reason: the ledger's (``shard_vanished``, ``shard_truncated``, ``shard_changed``,
``shard_crashed``, ``killed_run`` among them), ``not_processed`` (no row: its shard never ran, or its run was
killed), ``file_missing``, ``file_size_mismatch``, ``fingerprint_mismatch``, ``duplicate_output`` (its done row
points at a file an earlier sample, same group and id in another shard, already counts) or, when content is
checked (`latentforge reconcile` without ``--quick``), ``file_damaged`` (not the sha256 its ledger recorded). Rows of
samples the plan does not list (gone from the source before the run began, or added to it after) are listed, never
counted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra import outdir
from infra import report_files as reports
from infra.audit.reconcile_report import GoneSample, GroupCounts, MissingSample, ReconcileReport, TruncatedPrompt
from infra.cache import ledger, listing
from infra.cache.ledger import WINDOWS_KEY, LedgerRow, windows_by_clip
from infra.formats import ShardFormat, get_format
from infra.formats.shards import part_record, write_meta
from infra.gates.content import ContentCheck
from infra.gates.unowned import Scan
from infra.job import Job
from infra.models import get_family
from infra.plan import ShardPlan
from infra.records import DamagedRecord, warn
from infra.sources import Source, open_source

__all__ = ["GoneSample", "MissingSample", "ReconcileReport", "reconcile", "write_reconcile_report"]

logger = logging.getLogger(__name__)

NOT_PROCESSED = "not_processed"
FILE_MISSING = "file_missing"
FILE_SIZE = "file_size_mismatch"
OTHER_SPEC = "fingerprint_mismatch"
DUPLICATE = "duplicate_output"  # two source samples (same group and id, two shards) map to one file
DAMAGED = "file_damaged"  # on disk at its size, but not the bytes the ledger recorded (content checked)


def reconcile(
    job: Job, shards: list[ShardPlan], source_shards: Sequence[str] | None = None, content: bool = False
) -> ReconcileReport:
    """Account for every sample of the plan's `shards` (its recorded listing, else the source listed now) in the
    ledgers and on disk; `source_shards`: the ids of the source's shards as the plan listed them (None: listed now);
    `content`: every file's sha256 against the ledger too (reads every byte: the build's own step does not)."""
    spec = job.spec
    kinds = list(get_family(spec.family).kinds(spec))
    report = ReconcileReport(str(job.out), job.source, job.fingerprint, spec.format, kinds, spec.text_max_length)
    tally = _Tally(job, report, functools.cache(functools.partial(_size, job.out)))
    if content:
        tally.content = ContentCheck(job.out, files=True, parts="sha256")
    fmt = get_format(spec.format, spec.family)
    if isinstance(fmt, ShardFormat):
        tally.members = functools.cache(lambda rel: frozenset(part_record(job.out, rel, fmt).members))
    source = open_source(job.source, job.spec)
    recorded = {entry["id"]: entry for entry in _index(job, report)}
    scan = Scan.of(job.out, fmt)  # what a trainer would load: every row's files taken off it
    for shard in shards:
        listed, every_key, whole = _expected(job, source, shard, recorded.get(shard.id), report)
        rows, note = _read_rows(job.out, shard.id, report)
        scan.owned(rows.values())
        accounted: set[str] = set()
        by_clip = windows_by_clip(rows)
        for key, sample_id, group in listed:
            for sub_key, sub_id, row in _samples_of(rows, by_clip.get(key, []), key, sample_id):  # one per window
                tally.account(MissingSample(sub_id, group, shard.id, sub_key, None, NOT_PROCESSED, note), row)
                accounted.add(sub_key)
        beyond = rows.keys() - accounted
        gone = beyond - every_key if whole else set()  # a shard not listed to its end cannot say what is gone
        report.unlisted += len(beyond - gone)
        report.gone_from_source += [_gone(rows[key]) for key in sorted(gone)]
    report.gone_from_source += _gone_shards(job, shards, source_shards, source)
    report.unowned = _unowned(job, shards, scan)
    if isinstance(fmt, ShardFormat):  # the shard index, last: what the parts hold now
        write_meta(job.out, fmt, job.fingerprint, ledger.read_all(job.out))
    logger.info("%s", report.headline())
    return report


def _unowned(job: Job, shards: list[ShardPlan], scan: Scan) -> list[str]:
    """What `scan` leaves once the rows of the shards outside the plan (an earlier, wider run's) own theirs too."""
    planned = {shard.id for shard in shards}
    for shard_id in ledger.shard_ids(job.out):
        if shard_id not in planned:
            rows, _ = _read_rows(job.out, shard_id, ReconcileReport("", "", "", "", [], 0))
            scan.owned(rows.values())
    return scan.unowned()


def _samples_of(
    rows: dict[str, LedgerRow], windows: list[LedgerRow], key: str, sample_id: str
) -> list[tuple[str, str, LedgerRow | None]]:
    """(key, id, row) of every sample a listed clip makes: itself, or each of its `windows` (windows its rows say
    it has but the ledger lacks are expected too, without a row)."""
    if not windows:
        return [(key, sample_id, rows.get(key))]
    found = [(row.key, row.id, row) for row in sorted(windows, key=lambda r: int(r.key.rpartition("@")[2]))]
    lacking = max(row.extra[WINDOWS_KEY] for row in windows) - len(windows)
    return found + [(f"{key}@?{i}", f"{sample_id}@?{i}", None) for i in range(lacking)]


def _gone(row: LedgerRow) -> GoneSample:
    return GoneSample(row.id, row.group, row.shard, row.key, row.status, row.path)


def _gone_shards(
    job: Job, shards: list[ShardPlan], source_shards: Sequence[str] | None, source: Source
) -> list[GoneSample]:
    """Every row of the ledgers of shards the source no longer has at all (not merely filtered out), but for the
    plan's own (a shard planned by an earlier run and gone since is accounted for as planned). The source's shards
    are the plan's listing of them (a build's), or listed now (a plan recorded in OUT)."""
    try:
        listed = source_shards if source_shards is not None else [s.id for s in source.shards()]
        present = set(listed) | {s.id for s in shards}
        gone = [ledger.read_shard(job.out, sid) for sid in ledger.shard_ids(job.out) if sid not in present]
    except (OSError, ValueError) as exc:
        logger.warning("cannot tell which shards are gone from the source: %s", exc)
        return []
    return [_gone(row) for rows in gone for _, row in sorted(rows.items())]


def _index(job: Job, report: ReconcileReport) -> list[dict[str, Any]]:
    """OUT's recorded plan entries ([] without one; a damaged index is a problem of every shard, listed now)."""
    try:
        return listing.read_index(job.out, strict=True) or []
    except DamagedRecord as exc:  # the line `verify` and a build give too (said once already: `recorded_plan`)
        report.shard_problems["*"] = str(exc)
        return []


def _expected(
    job: Job, source: Source, shard: ShardPlan, entry: dict[str, Any] | None, report: ReconcileReport
) -> tuple[list[tuple[str, str, str]], set[str], bool]:
    """(key, id, group) of the shard's planned samples, every key it lists and whether that is the whole shard: its
    recorded listing when `entry`, the recorded plan's, is this plan's shard; else the source's listing now."""
    if entry == shard.model_dump(mode="json"):
        try:
            planned = listing.read_listing(job.out, shard.id, strict=True)
        except DamagedRecord as exc:  # the one line `verify` and a build give too
            warn(exc)
            planned = None
            report.shard_problems[shard.id] = str(exc)
        if planned is not None:
            if shard.damage:  # as the shard task found it: what the plan could list is what it expects
                report.shard_problems[shard.id] = f"listed {len(planned)} sample(s), then: {shard.damage}"
            return planned, {key for key, _, _ in planned}, shard.whole
    return _list_shard(source, shard, report)


def _list_shard(
    source: Source, shard: ShardPlan, report: ReconcileReport
) -> tuple[list[tuple[str, str, str]], set[str], bool]:
    """(key, id, group) of the shard's selected samples, in order (the first `quota`: the build's selection);
    every key the shard lists; and whether it was listed to its end."""
    listed: list[tuple[str, str, str]] = []
    every_key: set[str] = set()
    try:
        with contextlib.closing(source.samples(shard.shard)) as samples:
            for ref in samples:
                every_key.add(ref.key)
                if shard.quota is None or len(listed) < shard.quota:
                    listed.append((ref.key, ref.id, ref.group))
    except (RuntimeError, OSError, ValueError) as exc:  # a damaged or vanished shard: counted up to the damage
        logger.warning("shard %s: %s", shard.id, exc)
        report.shard_problems[shard.id] = f"listed {len(listed)} sample(s), then: {exc}"
        return listed, every_key, False
    return listed, every_key, True


def _read_rows(out: Path, shard_id: str, report: ReconcileReport) -> tuple[dict[str, LedgerRow], str]:
    """The shard's ledger rows and what a sample without one means; an unreadable ledger is a shard problem."""
    try:
        return ledger.read_shard(out, shard_id), "no ledger row: its shard has not run, or its run was killed"
    except (OSError, ValueError) as exc:
        if isinstance(exc, DamagedRecord):  # the line verify gives as its problem
            warn(exc)
        note = f"ledger unreadable: {exc}"
        report.shard_problems[shard_id] = "; ".join(filter(None, (report.shard_problems.get(shard_id), note)))
        return {}, note


@dataclass
class _Tally:
    """Accounts expected samples into a report."""

    job: Job
    report: ReconcileReport
    size: Callable[[str | None], int | None]  # an OUT-relative file's size, cached (kinds may share a file)
    #: Output path → (key, shard) of the sample that claimed it (two strings a sample: held for the whole cache).
    owners: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: A shard file's sample keys (shard formats count the samples inside their files).
    members: Callable[[str], frozenset[str]] = field(default=lambda _: frozenset())
    #: Each file's sha256 against the ledger (None: sizes only).
    content: ContentCheck | None = None

    def account(self, missing: MissingSample, row: LedgerRow | None) -> None:
        """Count one expected sample as produced, or list it as missing with why."""
        counts = self.report.groups.setdefault(missing.group, GroupCounts(kinds=dict.fromkeys(self.report.kinds, 0)))
        counts.expected += 1
        if row is not None:
            missing.status, missing.reason, missing.detail = row.status, row.reason or row.status, row.detail
            if row.status == "done":
                verdict = self.judge_done(missing, row, counts)
                if verdict is None:
                    counts.produced += 1
                    return
                missing.reason, missing.detail = verdict
        self.report.missing.append(missing)

    def judge_done(self, missing: MissingSample, row: LedgerRow, counts: GroupCounts) -> tuple[str, str] | None:
        """Why a done row does not count as produced (reason, detail), or None when it does; notes truncation."""
        if row.fingerprint and row.fingerprint != self.job.fingerprint:
            return OTHER_SPEC, f"done for fingerprint {row.fingerprint}, not this one"
        if row.truncated:
            named = (missing.id, missing.group, missing.shard, missing.key)
            self.report.truncated.append(TruncatedPrompt(*named, row.tokens_total, self.report.max_length))
        claim = (missing.key, missing.shard)
        owner = self.owners.setdefault(f"{row.path}#{row.member}" if row.member else str(row.path), claim)
        if owner is not claim:
            return DUPLICATE, f"{row.path} is already the output of {owner[0]!r} in shard {owner[1]}"
        problems = self.check_outputs(row, counts)
        if problems:
            reasons = set(problems.values())
            reason = FILE_MISSING if FILE_MISSING in reasons else FILE_SIZE if FILE_SIZE in reasons else min(reasons)
            return reason, "; ".join(problems)
        return None

    def check_outputs(self, row: LedgerRow, counts: GroupCounts) -> dict[str, str]:
        """{problem: reason} over the output kinds (on disk, inside OUT, the ledger's size); counts kinds present."""
        problems: dict[str, str] = {}
        for kind in self.report.kinds:
            wanted = row.file_of(kind)
            if wanted is None:  # the sample has none of this kind, and the ledger says why
                reason = row.missing.get(kind, f"{FILE_MISSING}: no file for {kind}")
                problems[f"{kind}: {reason}"] = reason.split(":", 1)[0]
                continue
            size = self.size(wanted.path)
            if size is None:
                problems[f"{kind}: {wanted.path} not on disk"] = FILE_MISSING
            elif wanted.member is not None and wanted.member not in self.members(wanted.path):
                problems[f"{kind}: {wanted.path} has no sample {wanted.member!r}"] = FILE_MISSING
            elif wanted.member is None and wanted.bytes is not None and size != wanted.bytes:
                problems[f"{kind}: {wanted.path} has {size} bytes, the ledger {wanted.bytes}"] = FILE_SIZE
            elif self.content is not None and (why := self.content.file(wanted)) is not None:
                problems[f"{kind}: {wanted.path}: {why}"] = DAMAGED
            else:
                counts.kinds[kind] = counts.kinds.get(kind, 0) + 1
        return problems


def _size(out: Path, relpath: str | None) -> int | None:
    """Size of an OUT-relative file; None if it is absent, not a regular file, outside OUT or through a link (the
    door, `infra.outdir`, refuses those)."""
    if not relpath:
        return None
    try:
        return outdir.size(out, relpath)
    except (OSError, outdir.UnsafePath):
        return None


def write_reconcile_report(out: Path, report: ReconcileReport) -> tuple[Path, Path]:
    """``OUT/reports/reconcile-<UTC stamp>[-N].json`` and ``.md``: new files, never an overwrite."""
    files = {".json": reports.to_json_bytes(report.to_dict()), ".md": report.markdown().encode()}
    json_path, md_path = reports.write_new(reports.REPORTS_DIR, "reconcile", files, out=out)
    return json_path, md_path
