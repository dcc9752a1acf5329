"""Shard formats (webdataset, parquet): many samples per file, for caches of millions of samples.

Each source shard's samples stream into parts ``OUT/shards/<shard-id>-<part:05d>.<ext>``: the part being written
lives under a hidden temp name beside them and is linked into place (fsync, no clobber) when it is rotated (by
sample count or size) or when its writer closes. A part in place is never rewritten. Two shard tasks never write
the same name (the source shard's id is in it), even on different machines.

A sample's ledger row names its part (`path`), its key inside it (`member`) and its own bytes and sha256; when a
part is finished its record (size, sha256, members, fingerprint) goes to ``OUT/ledger/parts/<part>.json``. On
resume the writer of a source shard continues at the part after the last finished one: done rows in finished
parts are kept without reading their sources, rows that point at a part that never finished are re-encoded, so
the parts end byte-identical to those of an uninterrupted run. ``OUT/_meta.json`` (exact sample count, per-part
counts and sha256s, the fingerprint) is written last, by `write_meta`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from infra import outdir, records
from infra.cache.ledger import LEDGER_DIR, FileRecord, LedgerRow, holds, ledger_dir, move_aside
from infra.errors import ConfigError, LatentforgeError
from infra.faults import fault_point
from infra.formats.base import EncodedSample, Format, Writer, WrittenSample
from infra.outdir import OutFile
from infra.storage import TEMP_SUFFIX, AtomicFile, Written, atomic_file, atomic_write

logger = logging.getLogger(__name__)

SHARDS_DIR = "shards"
META_JSON = "_meta.json"
PARTS_DIR = "parts"  # under OUT/ledger: one record per finished part
#: Rotation defaults, CC12M-like: ~10k samples per file, files well under the Hub's per-file limits.
DEFAULT_SHARD_SAMPLES = 10_000
DEFAULT_SHARD_BYTES = 1 << 30


class MixedFingerprints(LatentforgeError):
    """Shards of two caches (two encoders, two specs) in one stream."""


class PartRecord(BaseModel):
    """A finished part: written when it is linked into place."""

    model_config = ConfigDict(extra="forbid")

    path: str  # OUT-relative
    bytes: int
    sha256: str
    samples: int
    members: list[str]
    fingerprint: str


class Sink:
    """An AtomicFile as the file object tarfile and pyarrow write to (counting, hashing)."""

    closed = False

    def __init__(self, handle: AtomicFile) -> None:
        self._handle = handle

    def write(self, data: bytes) -> int:
        return self._handle.write(bytes(data))

    def tell(self) -> int:
        return self._handle.tell()

    def flush(self) -> None:
        """Bytes reach the temp file on each write; fsync happens when the part is linked."""

    def writable(self) -> bool:
        return True


def shard_options(spec: Any) -> dict[str, Any]:
    """The rotation, dtype and layout settings of a CacheSpec (None: the defaults)."""
    names = ("shard_samples", "shard_bytes", "parquet_dtype", "layout")
    return {n: getattr(spec, n, None) for n in names} if spec is not None else {}


def part_path(shard_id: str, part: int, ext: str, layout: str | None = None) -> str:
    """OUT-relative name of part `part` of source shard `shard_id`. The ``cc12m`` layout names a source shard's
    part after its number, as the CC12M latent set does (``00000.tar``); a shard that does not fit one part goes on
    in ``00000-00001.tar``, ... (`cc12m_names`)."""
    if layout == "cc12m" and shard_id.isdigit():  # the plan refuses other source shards (sanity's scratch: not)
        number = f"{int(shard_id):05d}"
        return f"{SHARDS_DIR}/{number}.{ext}" if part == 0 else f"{SHARDS_DIR}/{number}-{part:05d}.{ext}"
    return f"{SHARDS_DIR}/{shard_id}-{part:05d}.{ext}"


def next_part(out: Path, shard_id: str, ext: str, layout: str | None = None) -> int:
    """The part after the last finished one of `shard_id` (0 when none is)."""
    if layout == "cc12m" and shard_id.isdigit():
        part = 0
        while outdir.is_file(out, part_path(shard_id, part, ext, layout)):
            part += 1
        return part
    pattern = re.compile(rf"^{re.escape(shard_id)}-(\d{{5}})\.{re.escape(ext)}$")
    found = [int(m.group(1)) for e in outdir.entries(out, SHARDS_DIR) if (m := pattern.match(e.name))]
    return max(found, default=-1) + 1


def cc12m_names(shards: list[Any], per_part: int | None) -> list[str]:  # ShardPlan-like: .id, .samples
    """What the plan says of the ``cc12m`` layout's part names (one line per source shard that needs more than one
    part); ConfigError for a source shard whose id is not a number (the layout names parts by it)."""
    notes = []
    for shard in shards:
        if not shard.id.isdigit():
            raise ConfigError(
                f"--layout cc12m names each part after its source shard's number (00000.tar): shard {shard.id!r} "
                "is not a number; use the default layout"
            )
        if per_part and shard.samples > per_part:
            first = part_path(shard.id, 0, "tar", "cc12m")
            notes.append(
                f"shard {shard.id}: {shard.samples} samples > --shard-samples {per_part}: parts {first}, then "
                f"{part_path(shard.id, 1, 'tar', 'cc12m')}, ..."
            )
    return notes


def part_record_rel(relpath: str) -> str:
    """OUT-relative path of a finished part's record."""
    return f"{LEDGER_DIR}/{PARTS_DIR}/{Path(relpath).name}.json"


def part_record_path(out: Path, relpath: str) -> Path:
    return ledger_dir(out) / PARTS_DIR / f"{Path(relpath).name}.json"


class ShardWriter(Writer):
    """Streams samples into parts. Subclasses say how a part begins, takes a sample and ends."""

    ext: ClassVar[str]

    def __init__(self, out: Path, fmt: ShardFormat, shard_id: str, options: dict[str, Any]) -> None:
        super().__init__(out, fmt)
        self.shard_id = shard_id
        self.max_samples = int(options.get("shard_samples") or DEFAULT_SHARD_SAMPLES)
        self.max_bytes = int(options.get("shard_bytes") or DEFAULT_SHARD_BYTES)
        self.options = options
        self.layout = options.get("layout")
        self.part = next_part(self.out, shard_id, self.ext, self.layout)
        self._stack: contextlib.ExitStack | None = None
        self._handle: AtomicFile | None = None
        self._members: list[str] = []
        self._fingerprint = ""

    @property
    def relpath(self) -> str:
        return part_path(self.shard_id, self.part, self.ext, self.layout)

    @abstractmethod
    def begin(self, sink: Sink, sample: EncodedSample) -> None:
        """Start a part (its first sample is `sample`)."""

    @abstractmethod
    def add(self, sample: EncodedSample) -> tuple[str, int, str]:
        """Append one sample to the open part: (its key there, its bytes, their sha256)."""

    @abstractmethod
    def end(self) -> None:
        """Finish the open part's container (a tar's end blocks, a parquet footer)."""

    def write(self, sample: EncodedSample, *, replace: bool = False) -> WrittenSample:
        if self._stack is None:
            self._open(sample)
        if sample.fingerprint != self._fingerprint:
            raise LatentforgeError(f"{self.relpath}: a sample of fingerprint {sample.fingerprint} in a part of another")
        member, size, sha = self.add(sample)
        self._members.append(member)
        fault_point("part")  # a sample in the open part, not yet visible
        written = WrittenSample([([], Written(self.out / self.relpath, size, sha))], member=member)
        if len(self._members) >= self.max_samples or self.size() >= self.max_bytes:
            self._finish()
        return written

    def size(self) -> int:
        """Bytes of the open part so far (what rotation by size looks at)."""
        return self._handle.tell() if self._handle is not None else 0

    def _open(self, sample: EncodedSample) -> None:
        self._stack = contextlib.ExitStack()
        self._handle = self._stack.enter_context(atomic_file(self.relpath, out=self.out))
        self._members, self._fingerprint = [], sample.fingerprint
        self.begin(Sink(self._handle), sample)

    def _finish(self) -> None:
        """End the part, link it into place, record it; the next sample opens the next part."""
        assert self._stack is not None and self._handle is not None
        self.end()
        self._stack.close()  # fsync + link: the part is visible, whole
        written = self._handle.written
        assert written is not None
        record = PartRecord(
            path=self.relpath,
            bytes=written.bytes,
            sha256=written.sha256,
            samples=len(self._members),
            members=self._members,
            fingerprint=self._fingerprint,
        )
        atomic_write(part_record_rel(self.relpath), record.model_dump_json().encode(), replace=True, out=self.out)
        self._stack, self._handle = None, None
        self.part += 1

    def close(self) -> None:
        if self._stack is not None:
            self._finish()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        elif self._stack is not None:  # an error: the open part is dropped (its rows are re-encoded by a rerun)
            self._stack.__exit__(exc_type, exc, tb)
            self._stack = None


class ShardFormat(Format):
    """A format that keeps many samples per file: ledger rows name a member of a part."""

    sharded = True
    has_fingerprint = True
    ext: ClassVar[str]

    def writer(self, out: Path) -> ShardWriter:
        return self.open_writer(out, None, "part")

    def paths(self, stem: str, kinds: Any) -> dict[str, str]:
        return {}  # no per-sample files: nothing to adopt or collide with

    def present(self, out: Path, file: FileRecord) -> bool:
        """The part is in place (finished parts are whole: the temp name holds an unfinished one)."""
        return outdir.is_file(out, file.path)

    def read(self, path: Path | OutFile) -> dict[str, Any]:
        """The first sample of a part (a whole part: `read_part`)."""
        return next(iter(self.read_part(path).values()))

    def read_file(self, out: Path, file: FileRecord) -> dict[str, Any]:
        part = OutFile(outdir.root(out), file.path)  # through the door to OUT
        return self.read_member(part, file.member) if file.member else self.read(part)

    # A part is a file named by the caller (a trainer's reader) or, below OUT, an `OutFile` opened through the door.
    @abstractmethod
    def read_part(self, path: Path | OutFile) -> dict[str, dict[str, Any]]:
        """Every sample of a part: member → record (the format's keys, metadata, fingerprint)."""

    @abstractmethod
    def read_member(self, path: Path | OutFile, member: str) -> dict[str, Any]:
        """One sample of a part (KeyError naming it when absent)."""

    @abstractmethod
    def fingerprints(self, path: Path | OutFile) -> set[str]:
        """The fingerprints a part's samples carry (read from its metadata, not its tensors where it can)."""

    @abstractmethod
    def copy_without(self, path: Path | OutFile, sink: Sink, drop: set[str]) -> list[str]:
        """Write the part at `path` into `sink` without the samples `drop` (members otherwise as they are, metadata
        kept): the members kept, in order."""


def part_record(out: Path, relpath: str, fmt: ShardFormat) -> PartRecord:
    """A finished part's record; made again from the file when a crash came between its link and its record."""
    rel = part_record_rel(relpath)
    if outdir.is_file(out, rel):  # the part's bytes as written: proof of the part, never made again over damage
        where = outdir.shown(out, rel)
        fix = f"move the part and its record out of OUT ({move_aside(out, [relpath, rel])}) and run the build again: "
        fix += "its samples are encoded again"
        return records.model(
            PartRecord,
            records.loads(outdir.read_bytes(out, rel), where, "a part record", fix),
            where,
            "a part record",
            fix,
        )
    file = OutFile(outdir.root(out), relpath)
    members = list(fmt.read_part(file))
    prints = sorted(fmt.fingerprints(file))
    record = PartRecord(
        path=relpath,
        bytes=outdir.size(out, relpath) or 0,
        sha256=outdir.sha256(out, relpath),
        samples=len(members),
        members=members,
        fingerprint=prints[0] if len(prints) == 1 else ",".join(prints),
    )
    atomic_write(rel, record.model_dump_json().encode(), replace=True, out=out)
    return record


def finished_parts(out: Path, ext: str) -> list[str]:
    """OUT-relative names of the parts in place, sorted (the temp names of unfinished ones are hidden)."""
    return sorted(
        f"{SHARDS_DIR}/{e.name}"
        for e in outdir.entries(out, SHARDS_DIR)
        if e.name.endswith(f".{ext}") and not e.name.startswith(".") and not e.name.endswith(TEMP_SUFFIX)
    )


def drop_superseded(out: Path, fmt: ShardFormat, rows: dict[str, dict[str, LedgerRow]]) -> list[str]:
    """Rewrite each finished part that still holds the old copy of a sample re-encoded by an approved stale
    replacement (its ledger row has ``replaced_stale`` and names another part): the approval covers that copy.
    Without it a plain reader (webdataset, FastVideo's parquet loader) would train on both copies. The part is
    written again under a temp name, fsynced and renamed over the old one (readers see the old part or the new,
    never half of one), then its record is made again. The OUT-relative parts rewritten."""
    replaced = {
        row.member: row.path
        for shard_rows in rows.values()
        for row in shard_rows.values()
        if row.status == "done" and row.member and row.extra.get("replaced_stale") is not None
    }
    rewritten = []
    for relpath in finished_parts(out, fmt.ext) if replaced else []:
        record = part_record(out, relpath, fmt)
        drop = {m for m in record.members if m in replaced and replaced[m] != relpath}
        if not drop:
            continue
        with atomic_file(relpath, replace=True, out=out) as handle:
            kept = fmt.copy_without(OutFile(outdir.root(out), relpath), Sink(handle), drop)
        written = handle.written
        assert written is not None
        update = {"bytes": written.bytes, "sha256": written.sha256, "samples": len(kept), "members": kept}
        body = record.model_copy(update=update).model_dump_json().encode()
        atomic_write(part_record_rel(relpath), body, replace=True, out=out)
        logger.info("%s: rewritten without %d superseded sample(s) (approved stale replacement)", relpath, len(drop))
        rewritten.append(relpath)
    return rewritten


def write_meta(out: Path, fmt: Format, fingerprint: str, rows: dict[str, dict[str, LedgerRow]]) -> Path | None:
    """``OUT/_meta.json``, written last: the exact count of samples in the parts (what a trainer streams), per part
    its count, size and sha256, the fingerprint, and the ledger's done count beside it; a part no ledger row names is
    not listed (nor its record made: `infra.gates.unowned` names it). None for a per-sample format. Parts holding
    superseded copies are rewritten first (`drop_superseded`)."""
    if not isinstance(fmt, ShardFormat):
        return None
    drop_superseded(out, fmt, rows)
    done = sum(row.status == "done" for shard_rows in rows.values() for row in shard_rows.values())
    owned = {file.path for shard_rows in rows.values() for row in shard_rows.values() for file in row.output_files()}
    shards = []
    for relpath in finished_parts(out, fmt.ext):
        if relpath not in owned:
            logger.warning("%s: no ledger row names it: left out of %s", outdir.shown(out, relpath), META_JSON)
            continue
        record = part_record(out, relpath, fmt)
        shards.append({"url": relpath, "samples": record.samples, "bytes": record.bytes, "sha256": record.sha256})
    meta = {
        "format": fmt.name,
        "fingerprint": fingerprint,
        "samples": sum(s["samples"] for s in shards),
        "ledger_done": done,
        "shards": shards,
    }
    body = (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode()
    root = outdir.root(out)
    if isinstance(root, Path) and holds(root, META_JSON, body):  # a resume that changed nothing: left as it is
        return root / META_JSON
    return atomic_write(META_JSON, body, replace=True, out=out).path


def shard_summary(out: Path, fmt: ShardFormat) -> dict[str, Any]:
    """What `latentforge inspect` shows of a shard format's files: how many, how many samples, and the
    fingerprints found in them (read from each part, not from the ledger), each with its number of parts."""
    prints: dict[str, int] = {}
    samples = 0
    parts = finished_parts(out, fmt.ext)
    for relpath in parts:
        for fingerprint in fmt.fingerprints(OutFile(outdir.root(out), relpath)):
            prints[fingerprint] = prints.get(fingerprint, 0) + 1
        samples += part_record(out, relpath, fmt).samples
    return {"files": len(parts), "samples": samples, "fingerprints": prints}
