"""Record, the trip's last stage: what became of a sample (`Outcome`) → its ledger row; the shard's counts.

Every sample ends as a row (done / skipped with a reason / failed with the error) that records its source identity
(the sha256 of the bytes read included) and every file written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from infra.cache.ledger import LedgerRow
from infra.job import Job
from infra.preprocess.encode import Encoded
from infra.preprocess.shard_result import ShardResult
from infra.preprocess.write import WrittenFiles
from infra.sources import SampleRef


@dataclass
class Outcome:
    """What became of one sample: written (encoded now, or adopted with its files' `facts`), or not, and why."""

    status: str = "failed"
    reason: str | None = None
    detail: str | None = None
    path: str | None = None  # the file in the way (output_exists before the trip)
    written: WrittenFiles | None = None
    encoded: Encoded | None = None
    facts: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # an approved replacement: what it replaced
    seconds: float = 0.0


def row(ref: SampleRef, job: Job, outcome: Outcome) -> LedgerRow:
    """The sample's ledger row."""
    made = LedgerRow(key=ref.key, id=ref.id, group=ref.group, shard="", status=outcome.status)
    made.reason, made.detail, made.path, made.seconds = outcome.reason, outcome.detail, outcome.path, outcome.seconds
    made.fingerprint, made.source = job.fingerprint, ref.identity
    made.extra.update(outcome.extra)
    written = outcome.written
    if written is None:
        return made
    files = written.files
    made.path, made.sha256, made.member = files[0].path, files[0].sha256, files[0].member
    made.bytes, made.files = sum(f.bytes for f in files), files if len(files) > 1 else []
    if written.adopted:
        made.extra["adopted"] = True
    if outcome.encoded is None:  # adopted: the shapes its files record
        facts = outcome.facts or {}
        made.latent_shape, made.seq_len = facts.get("latent_shape"), facts.get("seq_len")
        made.source_shape = facts.get("source_shape")
        return made
    sample = outcome.encoded.sample
    made.missing = dict(sample.info.get("missing_outputs") or {})
    made.source_shape, made.latent_shape, made.seq_len = sample.source_shape, sample.latent_shape, sample.seq_len
    made.tokens_total, made.truncated = outcome.encoded.tokens_total, outcome.encoded.truncated
    made.extra["sampling"] = sample.info["sampling"]
    if job.spec.buckets and "geometry" in sample.info:  # the bucket it went to: what inspect and the summary show
        made.extra["geometry"] = list(sample.info["geometry"])
    return made


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
    for final in rows:
        counts[final.status] += 1
        if final.reason:
            reasons[final.reason] += 1
        if final.status == "done":
            result.bytes += final.bytes or 0
    result.counts, result.reasons = dict(counts), dict(reasons)
