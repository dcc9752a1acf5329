"""Chunks of a large shard (``--chunk-size``): each its own task and its own ledger part, merged when all end.

A chunk is a range of the shard's clips (in source order). Its rows are journalled and sealed under
``OUT/ledger/chunks/<shard>.chunk-NNNNN`` (outside the ledger directory's listing, so no reader takes a part for a
shard); once every chunk of the shard has ended, the parts are merged over the shard's own ledger, sealed
atomically as the shard's ledger, and removed. Chunks cover disjoint samples, so no two tasks ever write the
same file; a part left by an interrupted run is read back by its chunk's next run (resume) and merged then.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from infra import outdir
from infra.cache import ledger
from infra.plan import ShardPlan
from infra.preprocess.shard_result import ShardResult
from infra.sources import retries

logger = logging.getLogger(__name__)

PARTS_DIR = "chunks"


class Chunk(BaseModel):
    """Clips [start, stop) of a shard (stop None: to the shard's quota or end)."""

    model_config = ConfigDict(frozen=True)

    index: int
    start: int
    stop: int | None

    def ledger_id(self, shard_id: str) -> str:
        """The ledger name of this chunk's part (a path under the ledger directory)."""
        return f"{PARTS_DIR}/{self.name(shard_id)}"

    def name(self, shard_id: str) -> str:
        """The chunk's own name: its ledger part's, and the prefix of a shard format's part files, so two chunks of
        one shard (perhaps on two machines) never write the same file."""
        return f"{shard_id}.chunk-{self.index:05d}"


def plan_chunks(shard: ShardPlan, chunk_size: int | None) -> list[Chunk] | None:
    """The chunks of `shard`, or None for one task (no chunk size, or a shard of at most that many clips). The
    last chunk runs to the quota, so a run takes the same clips chunked or not."""
    if chunk_size is None or shard.samples <= chunk_size:
        return None
    starts = list(range(0, shard.samples, chunk_size))
    return [
        Chunk(index=i, start=start, stop=starts[i + 1] if i + 1 < len(starts) else shard.quota)
        for i, start in enumerate(starts)
    ]


def merge(out: Path, shard_id: str, chunks: list[Chunk], results: list[ShardResult]) -> ShardResult:
    """Seal the shard's ledger from its own rows with every part's rows on top (parts in order), remove the
    parts, and return the shard's result (counts from the merged ledger, the chunks' work added up)."""
    rows = ledger.read_shard(out, shard_id)
    for chunk in chunks:
        rows.update(ledger.read_shard(out, chunk.ledger_id(shard_id)))
    ledger.seal(out, shard_id, rows.values())
    for chunk in chunks:
        outdir.unlink(out, ledger.sealed_rel(chunk.ledger_id(shard_id)))
        ledger.drop_journal(out, chunk.ledger_id(shard_id))
    outdir.rmdir(out, f"{ledger.LEDGER_DIR}/{PARTS_DIR}")  # only when empty
    return _combined(shard_id, rows.values(), results)


def _combined(shard_id: str, rows: object, results: list[ShardResult]) -> ShardResult:
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    combined = ShardResult(shard=shard_id)
    for row in rows:  # type: ignore[attr-defined]
        counts[row.status] += 1
        reasons.update([row.reason] if row.reason else [])
        combined.bytes += (row.bytes or 0) if row.status == "done" else 0
    combined.counts, combined.reasons = dict(counts), dict(reasons)
    for r in results:
        combined.encoded += r.encoded
        combined.reused += r.reused
        combined.encode_errors += r.encode_errors
        combined.stale_kept += r.stale_kept
        combined.stale_undecided += r.stale_undecided
        combined.text_calls += r.text_calls
        combined.prompts_encoded += r.prompts_encoded
        combined.vae_calls += r.vae_calls
        combined.vae_clips += r.vae_clips
        combined.store_retries = retries.add(combined.store_retries, r.store_retries)
        combined.seconds = max(combined.seconds, r.seconds)
        combined.interrupted = combined.interrupted or r.interrupted
    errors = [r.error for r in results if r.error]
    combined.error = "; ".join(errors) if errors else None
    return combined
