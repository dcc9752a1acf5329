"""The reader training code uses for a shard-format cache: streams samples from its webdataset tars or parquet
files, and refuses to stream two encoders' (two specs') samples together.

    from infra.formats.stream import stream_samples
    for sample in stream_samples("/data/cache"):   # OUT, OUT/shards, or a list of part files (or their URLs)
        latents, text = sample["latents"], sample["text_embeddings"]

Every part's fingerprint is read (tar json members, parquet key-value metadata) before the first sample is
yielded: parts of more than one fingerprint raise `MixedFingerprints` naming them, unless ``allow_mixed=True``
(each sample then carries its own ``fingerprint``). Tensors come back in the dtypes they were made in (bf16).
Given OUT itself, only the samples its ledgers name are streamed (an approved stale replacement also rewrites the
old part without its superseded copy: `infra.formats.shards.drop_superseded`), and each sample says under
``consumer`` which trainer the cache was written for and what it sees (`infra.formats.consumers.written_for`:
normalised latents or the raw posterior mean, text rows and stage, fps); tensors are as stored. OUT (or a part) may
be a URL (``s3://BUCKET/PREFIX``, `infra.outstore`): its objects are read through the door, each part as a stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from infra import outdir
from infra.cache import ledger
from infra.cache.cachedir import read_cache_json
from infra.formats.consumers import written_for
from infra.formats.parquet import ParquetFormat
from infra.formats.shards import SHARDS_DIR, MixedFingerprints, ShardFormat
from infra.formats.webdataset import WebDatasetFormat
from infra.outdir import OutFile, StoreOut

logger = logging.getLogger(__name__)

READERS: dict[str, ShardFormat] = {".tar": WebDatasetFormat(), ".parquet": ParquetFormat()}
#: A cache or part as `stream_samples` takes it: a local path, a URL (or `StoreOut`), or a list of part files.
Where = Path | str | StoreOut | Iterable[Path | str | StoreOut]
Part = Path | OutFile


def shard_files(where: Where) -> list[Part]:
    """The part files of a cache (OUT or OUT/shards) or the files given, in order; hidden temp parts never."""
    if outdir.is_store(where):
        return _store_files(outdir.root(where))  # type: ignore[arg-type]
    if isinstance(where, (str, Path)):
        root = Path(where)
        if root.is_file():
            return [root]
        folder = root / SHARDS_DIR if (root / SHARDS_DIR).is_dir() else root
        return sorted(p for p in folder.iterdir() if p.suffix in READERS and not p.name.startswith("."))
    return [part for p in where for part in (_store_files(outdir.root(p)) if outdir.is_store(p) else [Path(p)])]


def _store_files(where: StoreOut) -> list[Part]:
    """The parts below a URL (OUT, or OUT/shards), or the one part the URL names, each read through the door."""
    if outdir.is_file(where.parent, where.name):
        return [OutFile(where.parent, where.name)]
    folder = SHARDS_DIR if outdir.is_dir(where, SHARDS_DIR) else ""
    names = [e.name for e in outdir.entries(where, folder) if e.kind == "file"]
    return [OutFile(where, outdir.join(folder, n)) for n in names if Path(n).suffix in READERS and n[0] != "."]


def fingerprints(files: list[Part]) -> dict[str, list[str]]:
    """Fingerprint → the part files that carry it."""
    found: dict[str, list[str]] = {}
    for path in files:
        for fingerprint in _reader(path).fingerprints(path):
            found.setdefault(fingerprint, []).append(path.name)
    return found


def stream_samples(where: Where, *, allow_mixed: bool = False) -> Iterator[dict[str, Any]]:
    """Every sample of the parts, part by part: the record (latents, text_embeddings, prompt, fingerprint, ...)
    with ``__key__`` and ``__url__``. MixedFingerprints before the first sample when the parts are of two specs
    and not `allow_mixed`."""
    files = shard_files(where)
    found = fingerprints(files)
    if len(found) > 1 and not allow_mixed:
        listed = "; ".join(f"{fp[:16]}… in {', '.join(names[:3])}" for fp, names in sorted(found.items()))
        raise MixedFingerprints(
            f"these shards come from {len(found)} different encoders or specs ({listed}): refusing to stream them "
            "together (allow_mixed=True streams them, each sample with its fingerprint)"
        )
    live = _live_members(where)
    consumer = _consumer(where)
    if consumer:
        logger.info("a cache written for %s: %s", consumer["consumer"], consumer)
    skipped = 0
    for path in files:
        for key, record in _reader(path).read_part(path).items():
            if live is not None and (f"{SHARDS_DIR}/{path.name}", key) not in live:
                skipped += 1  # superseded (a stale sample re-encoded into a later part): the ledger names the new copy
                continue
            yield {"consumer": consumer, **record, "__key__": key, "__url__": str(path)}
    if skipped:
        logger.info("%d superseded sample(s) not streamed (the ledger names a newer copy)", skipped)


def _live_members(where: Where) -> set[tuple[str, str]] | None:
    """(shard file, key) of every done sample the ledgers of a cache name; None when `where` is not a cache with
    ledgers (files given one by one, or shards copied without their ledger: every member is streamed)."""
    if not isinstance(where, (str, Path, StoreOut)):
        return None
    root = _root(where)
    if not (
        outdir.is_dir(root, ledger.LEDGER_DIR) if isinstance(root, StoreOut) else (root / ledger.LEDGER_DIR).is_dir()
    ):
        return None
    rows = (row for shard in ledger.read_all(root).values() for row in shard.values())
    return {(row.path, row.member) for row in rows if row.status == "done" and row.path and row.member}


def _consumer(where: Where) -> dict[str, Any]:
    """What the cache at `where` (OUT) was written for, from its cache.json; {} for files given one by one (a
    parquet part says it in its own metadata)."""
    if not isinstance(where, (str, Path, StoreOut)):
        return {}
    try:
        return written_for(read_cache_json(_root(where))["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _root(where: Path | str | StoreOut) -> outdir.Out:
    """OUT as the door takes it: a `StoreOut` for a URL, else the local path."""
    return outdir.root(where) if outdir.is_store(where) else Path(where)


def _reader(path: Part) -> ShardFormat:
    reader = READERS.get(Path(path.name).suffix)
    if reader is None:
        raise ValueError(f"{path}: not a shard file (.tar or .parquet)")
    return reader
