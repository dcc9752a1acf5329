"""Write, the trip's fourth stage: an encoded sample's files through the format's writer → `WrittenFiles`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infra import outdir
from infra.cache.ledger import FileRecord
from infra.formats import EncodedSample, PerSampleWriter, Writer
from infra.job import Job
from infra.storage import NOT_WRITABLE_ERRNOS, not_writable


@dataclass(frozen=True)
class WrittenFiles:
    """A sample's files on disk (OUT-relative records); `adopted`: left by an interrupted run with these bytes."""

    files: list[FileRecord]
    adopted: bool = False


def write(job: Job, writer: Writer, sample: EncodedSample, present: list[str], replace: bool) -> WrittenFiles:
    """Write the sample. A format without a fingerprint in its files (the trainer's exact keys) adopts files
    `present` at its paths only when they hold exactly the bytes this run renders; any other file there is not
    overwritten (FileExistsError) unless `replace`. OutNotWritable when OUT (or a folder of it) refuses the write:
    every later sample would be refused too."""
    try:
        return _write(job, writer, sample, present, replace)
    except OSError as exc:
        if exc.errno in NOT_WRITABLE_ERRNOS:
            where = Path(exc.filename).parent if exc.filename and Path(exc.filename).is_absolute() else job.out
            raise not_writable(where, exc) from exc
        raise


def _write(job: Job, writer: Writer, sample: EncodedSample, present: list[str], replace: bool) -> WrittenFiles:
    if not present or replace or not isinstance(writer, PerSampleWriter):
        return WrittenFiles(writer.write(sample, replace=replace).records(job.out))
    rendered = writer.render(sample)
    same = {rel for _, rel, data in rendered if rel in present and outdir.read_bytes(job.out, rel) == data}
    if same != set(present):
        raise FileExistsError(f"{sorted(set(present) - same)[0]} exists with other bytes: not overwritten")
    return WrittenFiles(writer.write_rendered(rendered, present=frozenset(same)).records(job.out), adopted=True)
