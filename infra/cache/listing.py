"""The plan as the run listed it at its start, recorded in OUT: what reconciliation expects, and what a shard task
accounts for when its shard vanished, shrank or changed since (DESIGN, invariant 8).

``OUT/ledger/plan.json`` is the index: the newest build's planned shards, one small entry each (the plan's own
`ShardPlan` fields: id, path, size, mtime, quota, samples, whether the listing reached the shard's end).
``OUT/ledger/plan/<shard>.jsonl`` lists a shard's planned samples, one ``[key, id, group]`` line each in source
order: a few dozen bytes a sample on disk, streamed while the run plans, read back one shard at a time, so nothing
holds a whole source's samples in memory. A run lists into a spool outside OUT while it plans (OUT is not written
before the gates decide) and `install`s the spool under the writer lock before the first shard runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

from infra import outdir
from infra import records as read_back
from infra.cache.ledger import LEDGER_DIR
from infra.sources.identity import SourceIdentity
from infra.storage import atomic_file, atomic_write

logger = logging.getLogger(__name__)

INDEX = "plan.json"
LISTINGS = "plan"
INDEX_PATH = f"{LEDGER_DIR}/{INDEX}"
#: OUT-relative prefixes of the recorded plan: the build's own working record (it names the source's local paths),
#: not published (the sealed ledgers hold a row for each planned sample).
PLAN_PATHS = (f"{LEDGER_DIR}/{INDEX}", f"{LEDGER_DIR}/{LISTINGS}/")
#: One planned sample: its key in the shard, its id, its group.
Planned = tuple[str, str, str]
#: What happens to a recorded plan that does not read back: the next build makes it again from the source.
ABSENT = "treated as absent: the source is listed again, and the next build records its plan anew"
#: What happens to this run's own spool (outside OUT) that does not read back: the run stops; it lists again.
SPOOL_REPAIR = "this run's own listing spool; run the same command again: it lists the source again"


def listing_path(root: Path, shard_id: str) -> Path:
    """A shard's listing under `root` (a spool, or OUT's ``ledger/plan``)."""
    return Path(root) / f"{shard_id}.jsonl"


@contextlib.contextmanager
def spool_shard(spool: Path, shard_id: str) -> Iterator[Callable[[str, str, str], None]]:
    """Write one shard's listing into the spool directory: yields ``add(key, id, group)``, called in source order."""
    spool.mkdir(parents=True, exist_ok=True)
    with listing_path(spool, shard_id).open("w", encoding="ascii") as fh:  # JSON escapes: any name, even undecodable
        yield lambda key, sid, group: fh.write(json.dumps([key, sid, group]) + "\n")


def identities(spool: Path) -> Path:
    """Where a plan spools what its samples were listed as (`spool_identities`), beside its listing spool: the
    run's own working record, never recorded in OUT."""
    return spool.with_name(f"{spool.name}-identities")


@contextlib.contextmanager
def spool_identities(spool: Path, shard_id: str) -> Iterator[Callable[[str, str, str, SourceIdentity], None]]:
    """Write one shard's samples with their source identities as listed (what the stale check compares a done row
    with: `infra.gates.stale`) beside the spool: yields ``note(key, id, group, identity)``, called in source
    order."""
    path = listing_path(identities(spool), shard_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="ascii") as fh:
        yield lambda key, sid, group, identity: fh.write(
            json.dumps([key, sid, group, identity.model_dump(mode="json")]) + "\n"
        )


def read_identities(spool: Path, shard_id: str) -> Iterator[tuple[str, str, str, SourceIdentity]] | None:
    """A shard's samples as `spool_identities` spooled them ((key, id, group, identity), read as they come);
    None when the plan spooled none for it."""
    path = listing_path(identities(spool), shard_id)
    if not path.is_file():
        return None
    return _identities(path)


def records(spool: Path) -> Path:
    """Where a plan spools what each sample of a tar in a store was listed as (`spool_records`), beside its listing
    spool: the run's own working record, never recorded in OUT."""
    return spool.with_name(f"{spool.name}-records")


@contextlib.contextmanager
def spool_records(spool: Path, shard_id: str) -> Iterator[Callable[[Any], None]]:
    """Write one shard's samples as its listing found them (`SampleRef.listed`: a tar sample's member offsets), for
    its task to make them again without listing the tar (`Source.relisted`): yields ``add(listed)``, called in source
    order. A sample without a record (None) drops the shard's file: its task lists the shard."""
    path = listing_path(records(spool), shard_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    whole = True
    with path.open("w", encoding="ascii") as fh:  # JSON escapes: any member name, even undecodable

        def add(listed: Any) -> None:
            nonlocal whole
            whole = whole and listed is not None
            if whole:
                fh.write(json.dumps(listed) + "\n")

        yield add
    if not whole:
        path.unlink()


def read_records(spool: Path, shard_id: str) -> Generator[Any, None, None] | None:
    """A shard's samples as `spool_records` spooled them (read as they come); None when the plan spooled none."""
    path = listing_path(records(spool), shard_id)
    if not path.is_file():
        return None
    return _json_lines(path)


def _json_lines(path: Path) -> Generator[Any, None, None]:
    with path.open(encoding="ascii") as fh:
        yield from read_back.lines(fh, str(path), "a listing record", SPOOL_REPAIR)


def _identities(path: Path) -> Iterator[tuple[str, str, str, SourceIdentity]]:
    with path.open(encoding="utf-8") as fh:
        for number, value in enumerate(read_back.lines(fh, str(path), "a listed sample", SPOOL_REPAIR), 1):
            if not (isinstance(value, list) and len(value) == 4 and all(isinstance(v, str) for v in value[:3])):
                raise read_back.damaged(
                    f"{path}:{number}", "a listed sample", "not [key, id, group, identity]", SPOOL_REPAIR
                )
            key, sid, group, identity = value
            where = f"{path}:{number}"
            yield key, sid, group, read_back.model(SourceIdentity, identity, where, "a listed sample", SPOOL_REPAIR)


def install(out: outdir.Out, spool: Path, shards: list[dict[str, Any]]) -> None:
    """Record the plan in OUT, through its door (`infra.outdir`): each shard's spooled listing (replaced only where it
    differs, so a resume of an unchanged source rewrites nothing but the index), then the index of `shards` (plan
    entries) last."""
    for entry in shards:
        spooled, recorded = listing_path(spool, entry["id"]), _listing_rel(entry["id"])
        if not spooled.is_file() or _same_bytes(spooled, out, recorded):
            continue
        with spooled.open("rb") as src, atomic_file(recorded, replace=True, out=out) as dst:
            shutil.copyfileobj(src, dst)
    body = json.dumps({"shards": shards}, indent=1, sort_keys=True)
    atomic_write(f"{LEDGER_DIR}/{INDEX}", body.encode(), replace=True, out=out)


def _listing_rel(shard_id: str) -> str:
    return f"{LEDGER_DIR}/{LISTINGS}/{shard_id}.jsonl"


def _same_bytes(spooled: Path, out: outdir.Out, rel: str) -> bool:
    """Whether OUT's recorded listing `rel` holds the spooled one's bytes (False when there is none)."""
    if outdir.size(out, rel) != spooled.stat().st_size:
        return False
    with spooled.open("rb") as fa, outdir.open_read(out, rel) as fb:
        while block := fa.read(1 << 20):
            if block != fb.read(len(block)):
                return False
    return True


def read_index(out: outdir.Out, *, strict: bool = False) -> list[dict[str, Any]] | None:
    """The recorded plan's shard entries, in plan order; None when OUT has no recorded plan (a cache of an older
    latentforge, or none built yet). A damaged index is a record the next build makes again: treated as absent
    (None) with one warning line naming it (`strict`: raised, a `DamagedRecord`, for a caller that reports it)."""
    path, rel = outdir.shown(out, f"{LEDGER_DIR}/{INDEX}"), f"{LEDGER_DIR}/{INDEX}"
    if not outdir.is_file(out, rel):
        return None
    try:
        found = read_back.loads(outdir.read_bytes(out, rel), path, "a plan index", ABSENT)
        shards = found.get("shards") if isinstance(found, dict) else None
        if not isinstance(shards, list) or not all(
            isinstance(s, dict) and isinstance(s.get("id"), str) for s in shards
        ):
            raise read_back.damaged(path, "a plan index", "its shards are not a list of entries", ABSENT)
    except read_back.DamagedRecord as exc:
        if strict:
            raise
        read_back.warn(exc)
        return None
    return shards


def read_listing(out: outdir.Out, shard_id: str, *, strict: bool = False) -> list[Planned] | None:
    """A shard's planned samples as recorded, in source order; None when it has no record. A damaged one is treated
    as absent (None) with one warning line naming it, as a damaged index is (`strict`: raised)."""
    path, rel = outdir.shown(out, _listing_rel(shard_id)), _listing_rel(shard_id)
    if not outdir.is_file(out, rel):
        return None
    try:
        with io.TextIOWrapper(outdir.open_read(out, rel), encoding="utf-8") as fh:
            return _planned(fh, path, ABSENT)
    except read_back.DamagedRecord as exc:
        if strict:
            raise
        read_back.warn(exc)
        return None


def read_spooled(spool: Path, shard_id: str) -> list[Planned] | None:
    """A shard's planned samples as this run's plan listed them into its `spool` (before they are recorded in OUT),
    in source order; None when the plan listed none into it."""
    path = listing_path(spool, shard_id)
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as fh:
        return _planned(fh, path, SPOOL_REPAIR)


def recorded_damage(out: outdir.Out) -> list[read_back.DamagedRecord]:
    """What of OUT's recorded plan does not read back (its index, then each listing it names): what `verify` says
    and `reconcile` and a build treat as absent, the same lines."""
    try:
        entries = read_index(out, strict=True) or []
    except read_back.DamagedRecord as exc:
        return [exc]
    found = []
    for entry in entries:
        try:
            read_listing(out, entry["id"], strict=True)
        except (read_back.DamagedRecord, outdir.UnsafePath) as exc:
            found.append(
                exc
                if isinstance(exc, read_back.DamagedRecord)
                else read_back.damaged(outdir.shown(out, LEDGER_DIR), "a plan listing", str(exc), ABSENT)
            )
    return found


def _planned(lines: Iterable[str], path: Path | str, repair: str) -> list[Planned]:
    planned: list[Planned] = []
    for number, value in enumerate(read_back.lines(lines, str(path), "a planned sample", repair), 1):
        if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, str) for v in value)):
            raise read_back.damaged(f"{path}:{number}", "a planned sample", "not [key, id, group]", repair)
        key, sid, group = value
        planned.append((key, sid, sys.intern(group)))  # a shard's few groups held once, not once a sample
    return planned


#: A shard's part of the plan's spools as bytes (`packed`): its listing, its samples' identities, their records.
Packed = dict[str, bytes]


def _spooled_files(spool: Path, shard_id: str) -> dict[str, Path]:
    return {
        "listing": listing_path(spool, shard_id),
        "identities": listing_path(identities(spool), shard_id),
        "records": listing_path(records(spool), shard_id),
    }


def packed(spool: Path, shard_id: str) -> Packed:
    """What the plan spooled of one shard (those of its files there), as bytes: what a shard task carries to a host
    that cannot read the driver's spool (a Ray cluster whose nodes share no disk), unpacked there by `task_spool`."""
    return {kind: path.read_bytes() for kind, path in _spooled_files(spool, shard_id).items() if path.is_file()}


@contextlib.contextmanager
def task_spool(given: str | Packed | None, shard_id: str) -> Iterator[Path | None]:
    """The spool a shard task reads the plan's listing from: the path it was given, or (given what `packed` took of
    the shard) a spool of this host's own below its temporary folder, removed at the end; None for none."""
    if not isinstance(given, dict):
        yield None if given is None else Path(given)
        return
    with tempfile.TemporaryDirectory(prefix="lf-listing-") as tmp:
        spool = Path(tmp) / "listing"
        for kind, path in _spooled_files(spool, shard_id).items():
            if kind in given:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(given[kind])
        yield spool
