"""A tar in a store, listed whole, kept on this machine: each sample's records of its listing (`SampleRef.listed`:
its members' offsets, sizes and mtimes), by the object's URL, size and version, so that a later plan of the same
object (a resume, another build from the same corpus) makes its samples from them (`Source.relisted`) instead of
reading every header again: a range request or two a sample, one after the other, at the store's latency (minutes
for a 10^4-member tar on a far store).

An entry is ``$LATENTFORGE_CACHE_DIR/listings/<sha256>.jsonl`` (`infra.runtime.machine_cache`): a first line that
says what was listed (URL, size, version, samples, the sha256 of the lines after it), then one JSON line a sample.
What is kept is a listing that reached the tar's end with no damage, of an object with a version (an S3 ETag or
version id, a Hub blob id, a GCS generation: an object rewritten since is another entry); an entry that does not say
what it should (cut short, damaged, its lines not the ones its first line's digest names, a record of another shape)
is listed again. It is latentforge's own record read back, so it is not trusted: a plan that uses it proves the tar's
first header and one record picked at random against the tar, and every record is proven where its bytes are read
(`infra.sources.relist`); one the tar does not bear out drops the entry (`forget`). About 200 bytes a sample; an
entry not used for `UNUSED_DAYS` is removed when a listing is kept (`prune`), and the folder is safe to delete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from infra.outstore import is_url
from infra.records import DamagedRecord, loads
from infra.runtime import machine_cache
from infra.sources.base import Shard
from infra.sources.tars import PLAIN_TAR
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

#: The source kinds whose shard is one tar, each sample made from its members' headers.
TAR_KINDS = ("vbvr", "wds")
FOLDER = "listings"
#: An entry not used (read or written) for this long is removed (`prune`): a corpus not planned for a month.
UNUSED_DAYS = 30


def relistable(kind: str, path: str) -> bool:
    """Whether a shard's samples can be made from records of its listing (`Source.relisted`): a plain tar in a store,
    of a tar kind. The one place this is decided (the plan's records, the shard task's, this cache)."""
    return kind in TAR_KINDS and is_url(path) and path.endswith(PLAIN_TAR)


def entry(shard: Shard) -> Path | None:
    """Where the listing of `shard` is kept on this machine; None for an object listed without a version."""
    if not shard.version or not shard.size:
        return None
    key = json.dumps([shard.path, shard.size, shard.version])
    return machine_cache(FOLDER) / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.jsonl"


def _head(shard: Shard, lines: list[str]) -> dict[str, Any]:
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return {"url": shard.path, "size": shard.size, "version": shard.version, "samples": len(lines), "sha256": digest}


def cached(shard: Shard) -> list[Any] | None:
    """The records kept of the object `shard` lists (its URL, size and version), in order; None when none are kept or
    the entry is not whole (it is then listed again, and kept anew)."""
    path = entry(shard)
    if path is None or not path.is_file():
        return None
    try:
        with path.open(encoding="ascii") as fh:
            head = loads(fh.readline() or "null", str(path), "a kept listing")
            lines = [line.rstrip("\n") for line in fh]
        if not isinstance(head, dict) or head != _head(shard, lines):
            raise DamagedRecord(f"{path}: not the kept listing of {shard.path} (its first line or digest differ)")
        records = [loads(line, f"{path}:{n}", "a listing record") for n, line in enumerate(lines, 2)]
    except (OSError, ValueError) as exc:
        logger.warning("%s: listed again (%s)", path, exc)
        forget(shard)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: `prune` keeps it
    return records


def keep(shard: Shard, records: list[Any]) -> None:
    """Keep `records` (a whole listing of `shard`, without damage) on this machine; a cache that cannot be written is
    a warning, never an error (the next plan lists the tar again)."""
    path = entry(shard)
    if path is None or any(record is None for record in records):
        return
    body = [json.dumps(record) for record in records]  # JSON escapes: any member name
    lines = [json.dumps(_head(shard, body)), *body]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, ("\n".join(lines) + "\n").encode("ascii"), replace=True)
    except OSError as exc:
        logger.warning("the listing of %s is not kept on this machine (%s)", shard.path, exc)
    if path.parent not in _pruned:  # once a process: a plan keeps a listing a tar
        _pruned.add(path.parent)
        prune(path.parent)


def forget(shard: Shard) -> None:
    """Drop this machine's kept listing of `shard` (one the tar does not bear out): the next plan lists it again."""
    path = entry(shard)
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


#: The folders this process has pruned.
_pruned: set[Path] = set()


def prune(folder: Path, now: float | None = None) -> int:
    """Remove the entries of `folder` not used for `UNUSED_DAYS` (by their mtime: each read touches it); returns how
    many. An entry another process removes first, or that cannot be removed, is left to it."""
    cutoff = (time.time() if now is None else now) - UNUSED_DAYS * 86400
    removed = 0
    for entry in folder.glob("*.jsonl"):
        with contextlib.suppress(OSError):
            if entry.stat().st_mtime < cutoff:
                entry.unlink()
                removed += 1
    if removed:
        logger.info("%d kept listing(s) unused for %d days removed from %s", removed, UNUSED_DAYS, folder)
    return removed
