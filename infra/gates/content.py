"""Whether a cache's files still hold the bytes the ledger recorded when they were written.

A per-sample file (pt, ltx) is hashed and compared with its ledger row's sha256; a part of a shard format
(webdataset, parquet) with its part record (``ledger/parts/<part>.json``, made when the part was linked into
place: its size and sha256), once per part, and every done sample in a damaged part is damaged with it.

What it costs: a full check reads every byte of the cache (`latentforge verify`, `latentforge reconcile`); the quick
check compares parts' sizes with their records and hashes only the few samples verify loads anyway (a build's
verify-existing before it resumes, ``--quick``). Files are read only; nothing is loaded, nothing is written.

The repair of a damaged sample: move its files out of OUT (to ``OUT.damaged/``, keeping their paths) and run the
build again: a done sample whose file is gone is encoded again, and nothing latentforge did not just write is ever
replaced without an approval.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from infra import outdir, records
from infra.cache.ledger import FileRecord, LedgerRow
from infra.formats.shards import part_record_rel

#: spot: sizes of every file, and the few samples verify loads hashed; all: every file hashed.
Content = Literal["spot", "all"]


@dataclass(frozen=True)
class Damaged:
    """A done sample whose file is not what its ledger row recorded."""

    shard: str
    key: str
    group: str
    id: str
    path: str
    why: str

    @property
    def selector(self) -> str:
        return f"{self.shard}/{self.key}"


@dataclass
class ContentCheck:
    """Checks done rows' files: per-sample files hashed when `files`; parts checked by `parts` (their size, or their
    sha256, against their record), each part once. Every file is read through OUT's door (`infra.outdir`): a path
    that leaves OUT or passes a link is not read here (the size check reports it)."""

    out: Path
    files: bool
    parts: Literal["size", "sha256"] | None
    #: A part's verdict (None: whole), by OUT-relative path: a part holds many samples, it is read once.
    seen: dict[str, str | None] = field(default_factory=dict)

    def row(self, row: LedgerRow) -> list[Damaged]:
        """The row's damaged files (a file of the wrong size, or absent, is left to the size check)."""
        found = []
        for file in row.output_files():
            why = self.file(file)
            if why is not None:
                found.append(Damaged(row.shard, row.key, row.group, row.id, file.path, why))
        return found

    def file(self, file: FileRecord) -> str | None:
        """Why a ledger's file record is damaged, or None (whole, or not this check's to judge)."""
        return self._part(file) if file.member is not None else self._sample_file(file)

    def _sample_file(self, file: FileRecord) -> str | None:
        if not self.files or _size(self.out, file.path) != file.bytes:
            return None
        sha = outdir.sha256(self.out, file.path)
        if sha == file.sha256:
            return None
        return f"sha256 {sha[:16]}… on disk, {file.sha256[:16]}… in the ledger: its bytes changed since written"

    def _part(self, file: FileRecord) -> str | None:
        if self.parts is None:
            return None
        if file.path not in self.seen:
            self.seen[file.path] = self._part_verdict(file.path)
        return self.seen[file.path]

    def _part_verdict(self, relpath: str) -> str | None:
        record_rel = part_record_rel(relpath)
        found_size = _size(self.out, relpath)
        if found_size is None or _size(self.out, record_rel) is None:
            return None  # absent: the size check's; no record (a crash before it was made): nothing to compare
        name = outdir.split(record_rel)[1]
        try:  # read back bounded (`infra.records`): its size and sha256 are what the part is proven against
            record = records.loads(outdir.read_bytes(self.out, record_rel), name, "a part record")
            size, sha = record["bytes"], record["sha256"]
            if type(size) is not int or not isinstance(sha, str):
                raise TypeError("its bytes or sha256 of another type")
        except records.DamagedRecord as exc:
            return f"its part record {exc}"
        except (OSError, KeyError, TypeError) as exc:
            return f"its part record {name} is unreadable ({type(exc).__name__})"
        if found_size != size:
            return f"the part has {found_size} bytes, its record {size}"
        if self.parts == "sha256" and (found := outdir.sha256(self.out, relpath)) != sha:
            return f"the part's sha256 {found[:16]}… is not its record's {sha[:16]}…"
        return None


def _size(out: Path, relpath: str) -> int | None:
    """The size of the regular file at OUT/relpath, through the door; None when absent, outside OUT or behind a link
    (what the size check and verify's path checks report)."""
    try:
        return outdir.size(out, relpath)
    except outdir.UnsafePath:
        return None


def problem(damaged: Damaged, out: Path) -> str:
    """One line of a report's problems."""
    return f"{out / damaged.path}: {damaged.why} (sample {damaged.selector})"


def repair_commands(out: Path, relpaths: list[str]) -> list[str]:
    """Shell lines that move each damaged file (OUT-relative) out of OUT into ``OUT.damaged/``, its path kept; the
    build run again then encodes those samples again."""
    paths = sorted(set(relpaths))
    if not paths:
        return []
    if outdir.is_store(out):  # an object store: moved aside with its own command line
        aside = f"{out}.damaged"
        return [f"aws s3 mv -- {shlex.quote(f'{out}/{p}')} {shlex.quote(f'{aside}/{p}')}" for p in paths]
    aside = out.with_name(f"{out.name}.damaged")
    folders = sorted({(aside / p).parent.as_posix() for p in paths})
    lines = [f"mkdir -p -- {' '.join(shlex.quote(f) for f in folders)}"]
    lines += [f"mv -- {shlex.quote((out / p).as_posix())} {shlex.quote((aside / p).as_posix())}" for p in paths]
    return lines


def repair_lines(commands: list[str], content: Content, limit: int) -> list[str]:
    """What a report says under Repair: the first `limit` shell lines (``--json`` has them all), then the build."""
    if not commands:
        return []
    lines = commands[:limit]
    if len(commands) > limit:
        lines.append(f"... and {len(commands) - limit} more lines: latentforge verify --json")
    how = "every file was hashed" if content == "all" else "only the samples loaded were hashed: verify hashes all"
    return [*lines, f"then run the build that made OUT again: it encodes these samples again ({how})"]
