"""Record, the trip's last stage: what became of a sample → its ledger row, and the shard's counts.

Every sample ends as a row (done / skipped with a reason / failed with the error) that records its source identity
and every file written. On resume a done row is kept when its files are still there (`reusable`), checked against
the source as listed now (`resumed`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from infra.cache.ledger import LedgerRow
from infra.formats import get_format
from infra.gates.plan import BuildPlan
from infra.gates.stale import kept, refreshed, source_state
from infra.preprocess.encode import Encoded
from infra.preprocess.result import ShardResult
from infra.preprocess.write import WrittenFiles
from infra.sources import SampleRef

logger = logging.getLogger(__name__)


def new_row(ref: SampleRef, plan: BuildPlan) -> LedgerRow:
    """The row of a sample about to be made: failed until it is done, with its source identity."""
    row = LedgerRow(key=ref.key, id=ref.id, group=ref.group, shard="", status="failed", fingerprint=plan.fingerprint)
    row.source = ref.identity
    return row


def done(row: LedgerRow, written: WrittenFiles, encoded: Encoded | None = None, record: dict | None = None) -> None:
    """Mark `row` done with its files and shapes: from the sample just encoded, or from the `record` of files an
    interrupted run of this spec wrote (adopted, not encoded now)."""
    files = written.files
    row.status, row.path, row.sha256, row.member = "done", files[0].path, files[0].sha256, files[0].member
    row.bytes, row.files = sum(f.bytes for f in files), files if len(files) > 1 else []
    if written.adopted:
        row.extra["adopted"] = True
    if encoded is None:
        facts: dict[str, Any] = record or {}
        row.latent_shape, row.seq_len = facts.get("latent_shape"), facts.get("seq_len")
        row.source_shape = facts.get("source_shape")
        return
    sample = encoded.sample
    row.missing = dict(sample.info.get("missing_outputs") or {})
    row.source_shape, row.latent_shape, row.seq_len = sample.source_shape, sample.latent_shape, sample.seq_len
    row.tokens_total, row.truncated = encoded.tokens_total, encoded.truncated
    row.extra["sampling"] = sample.info["sampling"]


def reusable(row: LedgerRow | None, plan: BuildPlan) -> bool:
    """Done for this fingerprint and every one of its files on disk at the ledger's size."""
    if row is None or row.status != "done" or row.fingerprint != plan.fingerprint:
        return False
    files, fmt = row.output_files(), get_format(plan.spec.format)
    return bool(files) and all(fmt.present(plan.out, f) for f in files)


def resumed(
    row: LedgerRow, ref: SampleRef, plan: BuildPlan, selector: str, result: ShardResult
) -> tuple[LedgerRow, str | None]:
    """A done sample on resume, checked against its source as listed now: (the row to keep; the old file's sha256
    when an approved stale replacement re-encodes it, else None)."""
    state, changed = source_state(row, ref)
    if state == "stale" and selector in plan.stale_replace:
        return row, row.sha256 or ""
    result.reused += 1
    if state == "refreshed":
        return refreshed(row, ref), None
    if state == "stale" and selector in plan.stale_keep:
        result.stale_kept += 1
        return kept(row, ref), None
    if state == "stale":  # changed after the stale gate looked: keep the output, the next run asks
        result.stale_undecided += 1
        logger.warning("%s changed in the source during this run (%s): kept as it was", selector, changed)
    return row, None


def count_new(result: ShardResult, row: LedgerRow) -> None:
    """Count a row this run produced."""
    adopted = bool(row.extra.get("adopted"))
    result.encoded += row.status == "done" and not adopted
    result.reused += adopted
    result.encode_errors += row.reason == "encode_error"


def tally(result: ShardResult, rows: Iterable[LedgerRow]) -> None:
    """The shard's counts by status and reason, and its bytes, from its final rows."""
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for row in rows:
        counts[row.status] += 1
        if row.reason:
            reasons[row.reason] += 1
        if row.status == "done":
            result.bytes += row.bytes or 0
    result.counts, result.reasons = dict(counts), dict(reasons)
