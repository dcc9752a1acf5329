"""A resumed shard with nothing to encode is visited from the plan's listing, not its source's: the plan listed every
shard at the run's start and spooled what each sample of a resumed one was listed as (`infra.cache.listing`), and a
shard task whose every sample is done, kept as it is, and whose file is the one the plan listed (its size and mtime,
or an object's version: one HEAD) takes those refs instead of listing the file again. A tar in a store is then not
read at all (listing it costs ~2 range requests a sample).

A shard in a store with samples to encode is not listed again either where the plan recorded what its listing found
(`infra.cache.listing.spool_records`: each sample's member offsets): `relisted` makes the same refs from those
records (`Source.relisted`), the tar opened, pinned to the object listed, but its headers not read. Listing a tar
in a store costs a range request or two a sample, one after the other, before its first sample can start (2.5 s of
a 24-sample shard's 10 s on the loopback S3; minutes for a 10^4-member shard on a far store), and its requests
again; a sample's own reads are then a range request or two (`bench/store_build_bench.py`).

Anything else is listed as before: a sample to encode, a row the listing would change (refreshed, stale, replaced),
a chunk, ``--only``, the text-first phase, ``windows:K``, a source whose shard is not one tar (vbvr, wds), one with
damage, duplicates or name collisions, a plan that spooled nothing for it (a first run; a worker that cannot see
the spool).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

from infra.cache.ledger import LedgerRow
from infra.cache.listing import read_records
from infra.gates.stale import NeedsBytes, source_state, spooled
from infra.job import Job
from infra.media.temporal import TemporalPolicy
from infra.outstore import is_url
from infra.plan import ShardPlan
from infra.preprocess import resume
from infra.sources import SampleRef, Shard, Source, listing_cache, store
from infra.sources.vbvr import TAR_SUFFIXES

logger = logging.getLogger(__name__)

#: The states of a done row that a visit keeps as it is (`infra.preprocess.resume.resumed`).
KEPT_AS_IS = ("same", "kept", "unknown")


def kept_listing(
    job: Job, shard: ShardPlan, previous: dict[str, LedgerRow], spool: Path | None, whole: bool
) -> list[SampleRef] | None:
    """The shard's samples as the plan listed them, when every one is done and would be kept as it is and the
    shard's file is unchanged since; None: list the source. `whole`: the task visits the whole shard, every sample
    (no chunk, no ``--only``, no text-first phase)."""
    if spool is None or not whole or shard.duplicates or shard.collisions or shard.damage is not None:
        return None
    kind = job.source.partition(":")[0]
    if TemporalPolicy.of(job.spec).kind == "windows" or kind not in listing_cache.TAR_KINDS:
        return None
    if not shard.path.endswith(TAR_SUFFIXES):
        return None
    listed = spooled(spool, shard)
    if listed is None:
        return None
    refs = list(itertools.islice(listed, shard.quota))
    for ref in refs:
        row = previous.get(ref.key)
        if row is None or not resume.reusable(row, job):
            return None
        try:
            state, _ = source_state(row, ref)
        except NeedsBytes:  # only its mtimes changed: the visit reads its bytes (a listing's ref can)
            return None
        if state not in KEPT_AS_IS:
            return None
    if not refs or not unchanged(shard.shard):
        return None
    logger.info("shard %s: every sample done and unchanged; its source is not listed again", shard.id)
    return refs


def relisted(shard: ShardPlan, source: Source, spool: Path | None) -> Iterator[SampleRef] | None:
    """The shard's samples made from the plan's records of its listing (`Source.relisted`), for a tar in a store
    that the plan listed without damage and that is the object listed (one HEAD); None: list the source."""
    if spool is None or shard.damage is not None or not listing_cache.relistable(source.kind, shard.path):
        return None
    records = read_records(spool, shard.id)
    if records is None:
        return None
    if not unchanged(shard.shard):
        records.close()
        return None
    logger.info("shard %s: made from the plan's listing; its tar's headers are not read again", shard.id)
    return source.relisted(shard.shard, records)


def shard_samples(shard: ShardPlan, source: Source, spool: Path | None) -> Iterator[SampleRef]:
    """The shard's samples: made from the plan's records of its listing where it has them (`relisted`), else listed
    from the source (the shard task's listing, the sanity's)."""
    samples = relisted(shard, source, spool)
    return samples if samples is not None else source.samples(shard.shard)


def unchanged(shard: Shard) -> bool:
    """Whether the shard's file is the one listed (size and mtime, or an object's size and version); False for a
    shard that is not one file listed with its size."""
    if not shard.size:
        return False
    try:
        if is_url(shard.path):
            return store.differences(store.Stat(shard.size, shard.version), store.stat(shard.path)) is None
        now = Path(shard.path).stat()
    except OSError:
        return False
    return now.st_size == shard.size and (not shard.mtime_ns or now.st_mtime_ns == shard.mtime_ns)
