"""Per-shard ledgers: every source sample ends as done, skipped (reason) or failed (error).

While a shard runs, each finished sample is appended to ``OUT/ledger/<shard>.journal.jsonl`` and
flushed to disk, so a crash loses no record. When the shard ends, its rows are sealed atomically
into ``OUT/ledger/<shard>.jsonl`` and the journal is removed. Readers take the sealed ledger, then
the journal on top; a torn last journal line (a crash mid-append) is ignored.

Before a sample's bytes are read the journal also gets a mark (``{"started": KEY, ...}``, `Journal.mark`); its row
follows when it ends. A mark with no row after it is a sample in progress when the process died
(`infra.preprocess.inflight`); readers skip marks unless asked for them, and a sealed ledger holds none.

Below an OUT in an object store an object cannot be appended to: the journal is a folder of part objects,
``OUT/ledger/<shard>.journal/<seq>.jsonl``, each a batch of lines put once (a conditional put) every
`JOURNAL_EVERY_SAMPLES` rows or `JOURNAL_EVERY_SECONDS` (`StoreJournal`). Readers take the parts in order after the
sealed ledger; sealing deletes them. A mark is put at once, with the rows kept (one part a sample read), so a sample
that takes the process down is seen in progress by the next run, as on disk. A crash loses the rows not yet put:
those samples are done again (a sample file of the run that has no row is adopted, as on disk).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra import outdir, records
from infra.faults import fault_point
from infra.outstore import StoreOut
from infra.sources.identity import SourceIdentity
from infra.sources.names import is_text, safe_text
from infra.storage import NOT_WRITABLE_ERRNOS, atomic_write, disk_full, is_disk_full, not_writable

logger = logging.getLogger(__name__)

LEDGER_DIR = "ledger"
Status = Literal["done", "skipped", "failed"]
#: The longest reason and detail a row keeps (an error quoting a whole caption would bloat every ledger line).
MAX_DETAIL_CHARS = 4000


class FileRecord(BaseModel):
    """One output file of a sample: OUT-relative path, size, sha256, and the output kinds it holds. In a shard
    format (webdataset, parquet) `path` is the shard file, `member` the sample's key in it, and `bytes` and
    `sha256` are the sample's own (its tensors and texts as stored), not the shard file's."""

    model_config = ConfigDict(extra="forbid")

    path: str
    bytes: int
    sha256: str
    kinds: list[str] = Field(default_factory=list, description="output kinds in this file ([]: all of them)")
    member: str | None = None


class LedgerRow(BaseModel):
    """One source sample's fate. Unknown keys are an error (a newer latentforge wrote the ledger): never ignored."""

    model_config = ConfigDict(extra="forbid")

    key: str  # the sample's key in its shard (unique within the shard)
    id: str
    group: str
    shard: str
    status: Status
    reason: str | None = None  # short code: missing_prompt, video_decode_error, ...
    detail: str | None = None  # human-readable error text
    path: str | None = None  # OUT-relative output path (the first file, where a format writes several)
    member: str | None = None  # the sample's key inside `path` (shard formats)
    bytes: int | None = None  # all of the sample's files
    sha256: str | None = None  # of the first file
    #: Where a format writes a file per output kind: every file (empty: the one file `path` holds every kind).
    files: list[FileRecord] = Field(default_factory=list)
    #: Output kinds this done sample has none of, and why (a clip without an audio track in an audio run).
    missing: dict[str, str] = Field(default_factory=dict)
    source_shape: list[int] | None = None
    latent_shape: list[int] | None = None
    seq_len: int | None = None
    tokens_total: int | None = None
    truncated: bool = False
    seconds: float = 0.0
    fingerprint: str | None = None
    #: What the sample was made from: its members as listed and the sha256 of the bytes read (None: a row
    #: written before latentforge recorded it).
    source: SourceIdentity | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reason", "detail", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return bounded(value) if isinstance(value, str) else value

    def output_files(self) -> list[FileRecord]:
        """Every file of the sample (one for formats that keep a sample in one file)."""
        if self.files:
            return list(self.files)
        if self.path and self.bytes is not None and self.sha256 is not None:
            return [FileRecord(path=self.path, bytes=self.bytes, sha256=self.sha256, member=self.member)]
        return []

    def file_of(self, kind: str) -> FileRecord | None:
        """The file holding output kind `kind`, or None (the sample has none: see `missing`)."""
        if kind in self.missing:
            return None
        return next((f for f in self.output_files() if not f.kinds or kind in f.kinds), None)

    def to_json(self) -> str:
        """One line; `member` only where a shard format sets it (rows of per-sample formats keep their old bytes,
        readable by a latentforge without shard formats)."""
        data = self.model_dump(mode="json")
        for name in ("reason", "detail"):  # set after construction (unvalidated): bounded here
            if isinstance(data[name], str):
                data[name] = bounded(data[name])
        for record in (data, *data["files"]):
            if record.get("member") is None:
                record.pop("member", None)
        line = json.dumps(data, sort_keys=True, ensure_ascii=False)
        # A lone surrogate anywhere (a name a source handed over undecoded) cannot be written as UTF-8: shown escaped.
        return line if is_text(line) else json.dumps(_writable(data), sort_keys=True, ensure_ascii=False)


def bounded(text: str) -> str:
    """A reason or detail as a row keeps it: writable (lone surrogates shown escaped), at most `MAX_DETAIL_CHARS`."""
    text = safe_text(text)
    if len(text) <= MAX_DETAIL_CHARS:
        return text
    keep = MAX_DETAIL_CHARS - 40  # room for the note, so that a bounded text is bounded again as it is
    return f"{text[:keep]}… ({len(text) - keep} more characters)"


def _writable(value: Any) -> Any:
    """`value` with every string in it (keys too) valid text: `safe_text`."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {safe_text(str(k)): _writable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_writable(v) for v in value]
    return value


#: A journal below a StoreOut is put as a part object every so many rows, or when its oldest line is this old (at the
#: next row or mark): what a crash can lose at most.
JOURNAL_EVERY_SAMPLES = 32
JOURNAL_EVERY_SECONDS = 15.0


def ledger_dir(out: outdir.Out) -> Path | StoreOut:
    return outdir.root(out) / LEDGER_DIR


#: LedgerRow.extra key of a windows:K sample (``key@FIRST``): how many windows its clip has.
WINDOWS_KEY = "windows"


def window_of(row: LedgerRow) -> tuple[str, int | None]:
    """(the clip's key in its shard, the window's first frame) of a row; (its key, None) for a whole clip."""
    if row.extra.get(WINDOWS_KEY):
        key, _, first = row.key.rpartition("@")
        return key, int(first)
    return row.key, None


def windows_by_clip(rows: dict[str, LedgerRow]) -> dict[str, list[LedgerRow]]:
    """A shard's windows:K rows by their clip's key (one pass over the rows; whole-clip rows are left out)."""
    by_clip: dict[str, list[LedgerRow]] = {}
    for row in rows.values():
        if row.extra.get(WINDOWS_KEY):
            by_clip.setdefault(window_of(row)[0], []).append(row)
    return by_clip


def sealed_rel(shard_id: str) -> str:
    """OUT-relative path of a shard's sealed ledger."""
    return f"{LEDGER_DIR}/{shard_id}.jsonl"


def journal_rel(shard_id: str) -> str:
    """OUT-relative path of a shard's journal."""
    return f"{LEDGER_DIR}/{shard_id}.journal.jsonl"


def parts_rel(shard_id: str) -> str:
    """OUT-relative folder of a shard's journal parts (an OUT in an object store)."""
    return f"{LEDGER_DIR}/{shard_id}.journal"


def sealed_path(out: outdir.Out, shard_id: str) -> Path | StoreOut:
    return outdir.root(out) / sealed_rel(shard_id)


def journal_path(out: outdir.Out, shard_id: str) -> Path | StoreOut:
    return outdir.root(out) / journal_rel(shard_id)


#: The key of a journal mark's line: the sample key whose trip started.
MARK = "started"
Marks = dict[str, list[dict[str, Any]]]


def _read_jsonl(out: outdir.Out, rel: str, *, tolerate_torn_tail: bool, marks: Marks | None = None) -> list[LedgerRow]:
    """The rows of a ledger or journal; its marks not followed by their sample's row go into `marks` (by key). A line
    that is not a row is a `DamagedRecord` naming the file, its line and the repair (`repair`): a ledger is the truth
    of what was done, never guessed over; only a journal's last line that is not JSON (a crash mid-append) is left."""
    path = outdir.shown(out, rel)
    try:
        # Lines end at "\n" only: str.splitlines would also cut at U+2028, U+0085 ..., which a name or caption can hold.
        lines = outdir.read_text(out, rel).split("\n")
    except (FileNotFoundError, NotADirectoryError):
        return []
    except UnicodeDecodeError as exc:
        raise records.damaged(path, "a ledger of UTF-8 lines", str(exc), repair(out, rel)) from None
    if lines[-1] == "":
        lines.pop()
    rows, fix = [], repair(out, rel)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = records.loads(line, f"{path}:{number}", "a ledger line", fix)
        except records.DamagedRecord as exc:
            if tolerate_torn_tail and number == len(lines) and exc.why == "json":
                logger.warning("%s: ignoring a torn last line (a crash mid-append)", path)
                continue
            raise
        if isinstance(data, dict) and isinstance(data.get(MARK), str) and "key" not in data:
            if marks is not None:
                marks.setdefault(data[MARK], []).append(data)
            continue
        if not isinstance(data, dict):  # whole JSON of another shape: damage, never a torn tail
            why = f"a row is a JSON object, not {type(data).__name__}"
            raise records.damaged(f"{path}:{number}", "a ledger row of this version", why, fix)
        rows.append(records.model(LedgerRow, data, f"{path}:{number}", "a ledger row of this version", fix))
        if marks is not None:
            marks.pop(rows[-1].key, None)  # the sample's row ends what its marks began
    return rows


def repair(out: outdir.Out, rel: str) -> str:
    """What repairs a damaged ledger or journal part at OUT-relative `rel`: moved out of OUT (into ``OUT.damaged``,
    its path kept, as verify moves a damaged sample), the build run again adopts the shard's sample files that are its
    own (their fingerprint, group and id checked) and encodes the rest; nothing done is lost."""
    adopts = "it adopts the sample files that are its own"
    return f"move it out of OUT ({move_aside(out, [rel])}) and run the build again: {adopts}"


def move_aside(out: outdir.Out, rels: list[str]) -> str:
    """One shell line that moves the OUT-relative files `rels` into ``OUT.damaged``, their paths kept (a store's with
    its own command line)."""
    root = outdir.root(out)
    if isinstance(root, StoreOut):
        moves = [
            f"aws s3 mv -- {shlex.quote(f'{root.url}/{r}')} {shlex.quote(f'{root.url}.damaged/{r}')}" for r in rels
        ]
        return " && ".join(moves)
    aside = root.with_name(f"{root.name}.damaged")
    folders = sorted({(aside / r).parent.as_posix() for r in rels})
    moves = [f"mv -- {shlex.quote((root / r).as_posix())} {shlex.quote((aside / r).as_posix())}" for r in rels]
    return " && ".join([f"mkdir -p -- {' '.join(shlex.quote(f) for f in folders)}", *moves])


def read_shard(out: outdir.Out, shard_id: str, marks: Marks | None = None) -> dict[str, LedgerRow]:
    """The latest row per sample key: sealed ledger, then the journal on top; the journal's marks whose sample has
    no row after them go into `marks`."""
    out = outdir.root(out)
    rows = {r.key: r for r in _read_jsonl(out, sealed_rel(shard_id), tolerate_torn_tail=False)}
    if isinstance(out, StoreOut):
        for part in journal_parts(out, shard_id):  # whole objects, in the order they were put
            rows.update({r.key: r for r in _read_jsonl(out, part, tolerate_torn_tail=False, marks=marks)})
        return rows
    journal = _read_jsonl(out, journal_rel(shard_id), tolerate_torn_tail=True, marks=marks)
    rows.update({r.key: r for r in journal})
    return rows


def journal_parts(out: StoreOut, shard_id: str) -> list[str]:
    """The OUT-relative names of a shard's journal parts in a store, in the order they were put."""
    folder = parts_rel(shard_id)
    return [f"{folder}/{name}" for name, kind in out.listing(folder) if kind == "file" and _seq(name) is not None]


def _seq(name: str) -> int | None:
    stem = name.removesuffix(".jsonl")
    return int(stem) if name.endswith(".jsonl") and stem.isdigit() else None


def shard_ids(out: outdir.Out) -> list[str]:
    """The ids of every shard with a ledger or a journal, sorted."""
    found = outdir.entries(out, LEDGER_DIR)
    names = [e.name for e in found if e.name.endswith(".jsonl")]
    names += [e.name + ".jsonl" for e in found if e.kind == "dir" and e.name.endswith(".journal")]  # a store's parts
    return sorted({name.removesuffix(".journal.jsonl").removesuffix(".jsonl") for name in names})


def read_all(out: outdir.Out) -> dict[str, dict[str, LedgerRow]]:
    """Every shard's rows: {shard_id: {key: row}}. Holds them all: a step over a large cache reads shard by shard
    (`shard_ids`, `read_shard`) where it can."""
    return {sid: read_shard(out, sid) for sid in shard_ids(out)}


def _trim_torn_tail(fd: int, path: Path) -> None:
    """Cut a torn last line (a crash mid-append) so that new rows start on a line of their own."""
    if os.fstat(fd).st_size == 0:
        return
    with os.fdopen(os.dup(fd), "r+b") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a torn last line (%d bytes) before appending", path, len(data) - keep)
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())


class Journal:
    """Append-only, one flushed and fsynced line per finished sample."""

    def __init__(self, out: Path, shard_id: str) -> None:
        self.path = journal_path(out, shard_id)
        self._fd = outdir.open_fd(out, journal_rel(shard_id), os.O_RDWR | os.O_APPEND | os.O_CREAT, create_dirs=True)
        _trim_torn_tail(self._fd, self.path)
        self._lock = threading.Lock()  # a read-ahead thread marks while the shard's thread appends

    def append(self, row: LedgerRow) -> None:
        """Append one whole line and fsync it. A full disk (DiskFull) leaves no torn line: the journal is cut back
        to where it was, so the row is simply not there and the next run redoes that sample."""
        self._write((row.to_json() + "\n").encode(), sync=True)

    def mark(self, key: str, **context: Any) -> None:
        """Note that sample `key`'s trip starts (its bytes are read next), with `context`. Written, not fsynced: a
        mark has to outlive the process (an out-of-memory kill, a decoder taking it down), not the machine, and the
        shard's hot loop pays one small write for it."""
        self._write((json.dumps({MARK: key, "pid": os.getpid(), **context}) + "\n").encode(), sync=False)

    def _write(self, data: bytes, *, sync: bool) -> None:
        with self._lock:
            self._write_locked(data, sync=sync)

    def _write_locked(self, data: bytes, *, sync: bool) -> None:
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):  # a nearly full disk can take part of a write without an error
                written += os.write(self._fd, data[written:])
            if sync:
                os.fsync(self._fd)
        except OSError as exc:
            if exc.errno in NOT_WRITABLE_ERRNOS:  # a read-only OUT: no sample after this one could be recorded
                raise not_writable(self.path, exc) from exc
            if not is_disk_full(exc):
                raise
            os.ftruncate(self._fd, size)
            raise disk_full(self.path, exc) from exc

    def flush(self) -> None:
        """Every line is on disk already (`append` fsyncs)."""

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreJournal:
    """A shard's journal below an OUT in an object store: lines kept in memory and put as one part object at each mark
    (a sample about to be read: the rows kept go with it), every `every` rows or when the oldest kept line is `seconds`
    old (checked at each row), and when it closes."""

    def __init__(
        self,
        out: StoreOut,
        shard_id: str,
        every: int = JOURNAL_EVERY_SAMPLES,
        seconds: float = JOURNAL_EVERY_SECONDS,
    ) -> None:
        self.path = out / parts_rel(shard_id)
        self._out, self._folder, self._every, self._seconds = out, parts_rel(shard_id), every, seconds
        found = [_seq(name) for name, _ in out.listing(self._folder)]
        self._next = max((n for n in found if n is not None), default=-1) + 1  # after an interrupted run's parts
        self._lines: list[bytes] = []
        self._rows, self._oldest = 0, 0.0
        self._lock = threading.RLock()  # a read-ahead thread marks while the shard's thread appends

    def append(self, row: LedgerRow) -> None:
        self._keep((row.to_json() + "\n").encode(), row=True)

    def mark(self, key: str, **context: Any) -> None:
        """Note that sample `key`'s trip starts, and put it now with the rows kept (one part): a sample that takes the
        process down is seen in progress by the next run, as on disk (`Journal.mark`)."""
        self._keep((json.dumps({MARK: key, "pid": os.getpid(), **context}) + "\n").encode(), row=False)
        self.flush()

    def _keep(self, line: bytes, *, row: bool) -> None:
        with self._lock:
            self._keep_locked(line, row=row)

    def _keep_locked(self, line: bytes, *, row: bool) -> None:
        if not self._lines:
            self._oldest = time.monotonic()
        self._lines.append(line)
        self._rows += row
        if self._rows >= self._every or time.monotonic() - self._oldest >= self._seconds:
            self.flush()

    def flush(self) -> None:
        """Put the kept lines as the next part (a conditional put: a part is never replaced)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._lines:
            return
        body = b"".join(self._lines)
        while True:
            try:
                self._out.put(f"{self._folder}/{self._next:08d}.jsonl", body, create=True)
                break
            except FileExistsError:  # a part put by a run that was still going: after it
                self._next += 1
        self._next += 1
        self._lines, self._rows = [], 0

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> StoreJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_journal(out: outdir.Out, shard_id: str) -> Journal | StoreJournal:
    """A shard's journal: appended to on disk, put in parts below an OUT in an object store."""
    out = outdir.root(out)
    return StoreJournal(out, shard_id) if isinstance(out, StoreOut) else Journal(out, shard_id)


def drop_journal(out: outdir.Out, shard_id: str) -> None:
    """Remove a shard's journal (its parts, in a store)."""
    out = outdir.root(out)
    if isinstance(out, StoreOut):
        out.delete_many(journal_parts(out, shard_id))
        return
    outdir.unlink(out, journal_rel(shard_id))


def seal(out: outdir.Out, shard_id: str, rows: Iterable[LedgerRow]) -> Path | StoreOut:
    """Write the shard's sealed ledger atomically (commit record), then drop its journal. On disk a ledger that
    holds these very bytes already (a resume that changed nothing) is left as it is: its time too, which an
    overwrite token covers (`infra.gates.conflicts.held`; in a store the same bytes keep their ETag anyway)."""
    out = outdir.root(out)
    body = "".join(r.to_json() + "\n" for r in rows).encode()
    rel = sealed_rel(shard_id)
    if isinstance(out, StoreOut) or not holds(out, rel, body):
        atomic_write(rel, body, replace=True, out=out)
    fault_point("seal")
    drop_journal(out, shard_id)
    return out / rel


def holds(out: Path, rel: str, body: bytes) -> bool:
    """Whether the file `rel` below the local OUT holds exactly `body` (its size checked first)."""
    try:
        return outdir.size(out, rel) == len(body) and outdir.read_bytes(out, rel) == body
    except (OSError, outdir.UnsafePath):
        return False
