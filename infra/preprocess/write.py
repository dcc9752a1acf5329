"""Write, the trip's fourth stage: an encoded sample's files through the format's writer → the files written.

Before a sample is encoded, the files already at its paths are looked at (`existing`): an interrupted run of this
spec may have written them (adopted: `ours`), or another's files are there (never overwritten without an approval).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.cache.ledger import FileRecord
from infra.cache.storage import sha256_file
from infra.formats import EncodedSample, PerSampleWriter, Writer, get_format
from infra.gates.plan import BuildPlan
from infra.sources import SampleRef


@dataclass(frozen=True)
class Existing:
    """The files already at a sample's output paths (OUT-relative, sorted); `complete`: every path has one."""

    files: list[str]
    complete: bool


@dataclass(frozen=True)
class WrittenFiles:
    """A sample's files on disk (OUT-relative records); `adopted`: left by an interrupted run with these bytes."""

    files: list[FileRecord]
    adopted: bool = False


def existing(plan: BuildPlan, ref: SampleRef) -> Existing:
    """What is at `ref`'s output paths now (nothing for a sample without a name: a layout error)."""
    paths = set(get_format(plan.spec.format).paths(ref.stem, plan.kinds).values()) if ref.stem else set()
    found = sorted(rel for rel in paths if (plan.out / rel).exists())
    return Existing(found, len(found) == len(paths))


def ours(plan: BuildPlan, files: list[str]) -> tuple[WrittenFiles, dict[str, Any]] | str:
    """Files at a sample's paths with no done row (an interrupted run wrote them): (the files, the first one's
    record) when every one carries this spec's fingerprint; else why they are another's."""
    fmt = get_format(plan.spec.format)
    try:
        records = {rel: fmt.read(plan.out / rel) for rel in files}
        prints = {r.get("fingerprint") if isinstance(r, dict) else None for r in records.values()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is simply not ours
        prints = {f"unreadable ({type(exc).__name__})"}
    if prints != {plan.fingerprint}:
        return f"{files[0]} exists and was not written by this spec (fingerprint {prints}); not overwritten"
    found = [
        FileRecord(path=rel, bytes=(plan.out / rel).stat().st_size, sha256=sha256_file(plan.out / rel)) for rel in files
    ]
    return WrittenFiles(found, adopted=True), records[files[0]]


def write(plan: BuildPlan, writer: Writer, sample: EncodedSample, present: list[str], replace: bool) -> WrittenFiles:
    """Write the sample. A format without a fingerprint in its files (the trainer's exact keys) adopts files
    `present` at its paths only when they hold exactly the bytes this run renders; any other file there is not
    overwritten (FileExistsError) unless `replace`."""
    if not present or replace or not isinstance(writer, PerSampleWriter):
        return WrittenFiles(writer.write(sample, replace=replace).records(plan.out))
    rendered = writer.render(sample)
    same = {rel for _, rel, data in rendered if rel in present and (plan.out / rel).read_bytes() == data}
    if same != set(present):
        raise FileExistsError(f"{sorted(set(present) - same)[0]} exists with other bytes: not overwritten")
    return WrittenFiles(writer.write_rendered(rendered, present=frozenset(same)).records(plan.out), adopted=True)
