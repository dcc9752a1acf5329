"""Resume, before a sample's trip: whether it needs one. A done row whose files are still there is kept (checked
against the source as listed now); files at a sample's paths with no done row were written by an interrupted run
of this spec for this sample (adopted: its fingerprint, group and id checked) or are another's (never overwritten
without an approval).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from infra import outdir
from infra.cache.ledger import FileRecord, LedgerRow
from infra.formats import get_format
from infra.gates.stale import kept, refreshed, source_state
from infra.job import Job
from infra.outdir import OutFile
from infra.preprocess.shard_result import ShardResult
from infra.preprocess.write import WrittenFiles
from infra.sources import SampleRef

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnDisk:
    """What is at a sample's output paths before its trip: the files (OUT-relative, sorted); `adopted` (with the
    first file's record, `facts`) when they are this spec's and complete; `foreign`: why they are not ours;
    `overwrite`: the trip replaces them (ours but incomplete, or another's with an approved overwrite)."""

    files: list[str]
    adopted: WrittenFiles | None = None
    facts: dict[str, Any] | None = None
    foreign: str | None = None
    overwrite: bool = False


def reusable(row: LedgerRow | None, job: Job) -> bool:
    """Done for this fingerprint and every one of its files on disk at the ledger's size."""
    if row is None or row.status != "done" or row.fingerprint != job.fingerprint:
        return False
    files, fmt = row.output_files(), get_format(job.spec.format, job.spec.family)
    return bool(files) and all(fmt.present(job.out, f) for f in files)


def wanted(ref: SampleRef, job: Job, previous: dict[str, LedgerRow], keys: frozenset[str] | None) -> bool:
    """Whether the build encodes `ref`: selected by ``--only`` (`keys` None: all) and not kept from the ledger
    (`previous`: the shard's rows)."""
    return (keys is None or selected(ref.key, keys)) and not reusable(previous.get(ref.key), job)


def selected(key: str, keys: frozenset[str]) -> bool:
    """Whether `--only` names clip `key` or one of its windows."""
    return key in keys or any(k.rpartition("@")[0] == key for k in keys)


def resumed(
    row: LedgerRow, ref: SampleRef, job: Job, selector: str, result: ShardResult
) -> tuple[LedgerRow, str | None]:
    """A done sample on resume, checked against its source as listed now: (the row to keep; the old file's sha256
    when an approved stale replacement re-encodes it, else None)."""
    state, changed = source_state(row, ref)
    if state == "stale" and selector in job.stale_replace:
        return row, row.sha256 or ""
    result.reused += 1
    if state == "refreshed":
        return refreshed(row, ref), None
    if state == "stale" and selector in job.stale_keep:
        result.stale_kept += 1
        return kept(row, ref), None
    if state == "stale":  # changed after the stale gate looked: keep the output, the next run asks
        result.stale_undecided += 1
        logger.warning("%s changed in the source during this run (%s): kept as it was", selector, changed)
    return row, None


def on_disk(job: Job, ref: SampleRef, *, replacing: bool) -> OnDisk:
    """The files at `ref`'s output paths (none for a sample without a name: a layout error); with a format that
    fingerprints its files, whether they are ours, unless the trip is `replacing` them (an approved stale one)."""
    fmt = get_format(job.spec.format, job.spec.family)
    paths = set(fmt.paths(ref.stem, job.kinds).values()) if ref.stem else set()
    files = sorted(rel for rel in paths if outdir.lstat(job.out, rel) is not None)  # a link there: UnsafePath
    if not files or replacing or not fmt.has_fingerprint:
        return OnDisk(files)
    found = _ours(job, ref, files)
    if isinstance(found, str):
        return OnDisk(files, foreign=found, overwrite=job.replace_from is not None)
    if len(files) == len(paths):
        return OnDisk(files, adopted=found[0], facts=found[1])
    return OnDisk(files, overwrite=True)  # ours, but not every file: made again


def _ours(job: Job, ref: SampleRef, files: list[str]) -> tuple[WrittenFiles, dict[str, Any]] | str:
    """(the files, the first one's record) when every file carries this spec's fingerprint and this sample's group
    and id (a copy of another sample's file, or another name that maps to this path, is not this sample's); else
    why not."""
    fmt = get_format(job.spec.format, job.spec.family)
    ours = (job.fingerprint, ref.group, ref.id)
    try:
        records = {rel: fmt.read(OutFile(job.out, rel)) for rel in files}
        marks = {_marks(record) for record in records.values()}
        theirs = "it carries " + "; ".join(
            f"fingerprint {f}, group {g!r}, id {i!r}" for f, g, i in sorted(marks, key=str)
        )
    except Exception as exc:  # noqa: BLE001 - any unreadable file is simply not ours
        marks, theirs = set(), f"not a sample file: it does not load ({type(exc).__name__})"
    if marks != {ours}:
        return (
            f"{files[0]} exists and was not written for this sample by this spec ({theirs}; this sample: "
            f"fingerprint {job.fingerprint}, group {ref.group!r}, id {ref.id!r}); not overwritten"
        )
    out = job.out
    found = [FileRecord(path=rel, bytes=outdir.size(out, rel) or 0, sha256=outdir.sha256(out, rel)) for rel in files]
    return WrittenFiles(found, adopted=True), records[files[0]]


def _marks(record: Any) -> tuple[Any, Any, Any]:
    """(fingerprint, group, id) a sample file carries (None for what it lacks)."""
    if not isinstance(record, dict):
        return None, None, None
    return record.get("fingerprint"), record.get("group"), record.get("id")
