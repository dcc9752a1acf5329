"""Listing the tars of a store for the plan: several at once, each from this machine's kept listing where it has one.

Listing a tar in a store reads its headers, a range request or two a sample, one after the other: at a far store's
latency (30 ms) a 1,000-clip shard takes a minute, and a corpus of 100 such shards over an hour before its first
sample. `listed_ahead` lists up to `AHEAD` shards in threads while the plan counts the current one; the plan's
decisions (counts, a sample met in two shards kept from the first, damage, caps, the spools) are still taken one
shard after the other, in the shards' order, from what each listing found: the plan is the one a listing one after
the other makes, byte for byte (local sources and a ``--limit`` run are listed one after the other).

`list_shard` lists one shard: a plain tar in a store of a tar kind (`listing_cache.relistable`) from this machine's
kept listing of the same object where there is one (no header read), else by reading its headers, its listing then
kept (`infra.sources.listing_cache`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from infra.sources import listing_cache
from infra.sources.base import SampleRef, Shard, ShardReadError, Source
from infra.sources.relist import NotAsListed

logger = logging.getLogger(__name__)

#: Shards listed at once ahead of the plan (threads waiting on a store's answers, not CPU).
AHEAD = 8


@dataclass(frozen=True)
class Listed:
    """One shard's listing: its samples, up to its cap, and the damage that cut it short (None: none)."""

    refs: list[SampleRef]
    damage: ShardReadError | None = None

    def replay(self) -> Iterator[SampleRef]:
        """The samples as `Source.samples` yields them: in order, then the damage raised."""
        yield from self.refs
        if self.damage is not None:
            raise self.damage


#: What the plan hands a shard and its cap to, for its listing.
Lister = Callable[[Shard, int | None], Listed]


def list_shard(source: Source, shard: Shard, cap: int | None) -> Listed:
    """The samples of `shard` up to `cap` (None: all), as `source.samples` lists them; a relistable tar from its kept
    listing where this machine has one, and its listing kept when it reached the tar's end without damage."""
    relistable = listing_cache.relistable(source.kind, shard.path)
    kept = listing_cache.cached(shard) if relistable else None
    refs: list[SampleRef] | None = None
    if kept is not None:
        refs, damage = _from_kept(source, shard, kept), None
    if refs is None:
        refs, damage = _listed(source, shard, None if relistable else cap)
        if relistable and damage is None:
            listing_cache.keep(shard, [ref.listed for ref in refs])
    if cap is not None and len(refs) >= cap:  # the cap reached before any damage: as a capped listing stops there
        return Listed(refs[:cap])
    return Listed(refs, damage)


def _from_kept(source: Source, shard: Shard, kept: list[Any]) -> list[SampleRef] | None:
    """The samples made from this machine's kept listing of `shard`, once its spot check holds (the tar's first
    header and one record picked at random, `infra.sources.relist`); None (the entry dropped, one warning) when the
    tar does not bear it out."""
    try:
        refs = list(source.relisted(shard, iter(kept), spot=True))
    except NotAsListed as exc:
        why = (shard.id, exc)
        logger.warning("shard %s: this machine's kept listing is not what the tar holds (%s): listed again", *why)
        listing_cache.forget(shard)
        return None
    logger.info("shard %s: its samples made from this machine's kept listing (no header read)", shard.id)
    return refs


def _listed(source: Source, shard: Shard, cap: int | None) -> tuple[list[SampleRef], ShardReadError | None]:
    refs: list[SampleRef] = []
    samples = source.samples(shard)
    try:
        for ref in samples:
            refs.append(ref)
            if cap is not None and len(refs) >= cap:
                break
    except ShardReadError as exc:
        return refs, exc
    finally:
        samples.close()  # type: ignore[attr-defined]  # a generator: its tar closed now, not when collected
    return refs, None


def listed_ahead(shards: list[tuple[Shard, int | None]], lister: Lister) -> Iterator[Listed]:
    """Each shard's listing in the shards' order, up to `AHEAD` of them listed at once in threads while the caller
    takes the one before. An error a listing raised is raised where that shard's turn comes; closing the iterator
    early cancels the listings not begun."""
    pool = ThreadPoolExecutor(max_workers=AHEAD, thread_name_prefix="plan-list")
    waiting: deque[Future[Listed]] = deque()
    todo = iter(shards)
    try:
        for shard, cap in todo:
            waiting.append(pool.submit(lister, shard, cap))
            if len(waiting) >= AHEAD:
                break
        while waiting:
            listed = waiting.popleft().result()
            for shard, cap in todo:  # one more begun for each taken
                waiting.append(pool.submit(lister, shard, cap))
                break
            yield listed
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
