"""What a cache publishes: the manifest of local files, built from the ledgers (never from a directory walk
of the data), and the gate that says whether the cache may be published at all.

Roles: every done ledger row's file is ``data`` (size and sha256 from the ledger, checked against the disk);
the reports latentforge wrote under ``reports/`` are ``report`` (upload reports are left out: they describe a
remote, not the cache; a file someone else put there is not the cache); the dataset card is ``card``; sealed
ledgers are ``ledger``; ``cache.json`` is the ``manifest``, sent last. Every file is found and read through the
door to OUT (`infra.outdir`), as verify finds it: a path outside OUT or a link stops the upload before anything
is sent.
``include``/``exclude`` globs narrow data and reports only: the manifest, ledgers and card always go,
so a remote holding one task family still says what the whole cache is.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from infra import outdir
from infra.audit.run_report import ReportError, latest_run_report
from infra.cache import ledger
from infra.cache.cachedir import CACHE_JSON, read_cache_json
from infra.config import UploadConfig
from infra.formats import ShardFormat, get_format
from infra.formats.shards import part_record
from infra.gates.cachefiles import CacheFiles, cache_files
from infra.outdir import OutFile
from infra.publish.base import ROLE_ORDER, LocalFile, PublishError, Role, Target
from infra.publish.card import card_file
from infra.report_files import REPORTS_DIR

logger = logging.getLogger(__name__)


@dataclass
class Manifest:
    """The files to publish (in send order) and what the cache is."""

    out: Path
    fingerprint: str
    files: list[LocalFile]
    #: Every path of the whole cache (before include/exclude): a remote file outside it is not ours.
    all_paths: set[str] = field(default_factory=set)
    excluded: int = 0

    def by_role(self, role: Role) -> list[LocalFile]:
        return [f for f in self.files if f.role == role]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def _matches(path: str, globs: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, g) or fnmatch.fnmatchcase(path, g.rstrip("/") + "/*") for g in globs)


def _on_disk(out: Path, relpath: str, role: Role) -> LocalFile:
    """A file of OUT as it is now (size and sha256 read through the door)."""
    size = outdir.size(out, relpath)
    if size is None:
        raise PublishError(f"{outdir.shown(out, relpath)}: not a file")
    return LocalFile(relpath, size, outdir.sha256(out, relpath), role, source=OutFile(outdir.root(out), relpath))


def _data_files(out: Path, problems: list[str]) -> list[LocalFile]:
    files: dict[str, LocalFile] = {}
    for shard, rows in ledger.read_all(out).items():
        for row in rows.values():
            if row.status != "done":
                continue
            for record in row.output_files():
                try:
                    size = outdir.size(out, record.path)  # a path outside OUT, or through a link: refused
                except outdir.UnsafePath as exc:
                    problems.append(f"ledger {shard}: done row {row.key!r}: {exc}")
                    continue
                if size is None:
                    problems.append(f"{record.path}: done in ledger {shard} but not on disk")
                    continue
                if record.member is not None:  # a sample inside a shard file: the whole file goes, once
                    if record.path not in files:
                        files[record.path] = _shard_file(out, record.path, problems)
                    continue
                if size != record.bytes:
                    problems.append(f"{record.path}: {size} bytes on disk, ledger {shard} says {record.bytes}")
                    continue
                seen = files.get(record.path)
                if seen is not None and seen.sha256 != record.sha256:
                    problems.append(f"{record.path}: two ledger rows with different sha256 (duplicate output)")
                source = OutFile(outdir.root(out), record.path)
                files[record.path] = LocalFile(record.path, record.bytes, record.sha256, "data", source=source)
    return list(files.values())


def _shard_file(out: Path, relpath: str, problems: list[str]) -> LocalFile:
    """A shard file (many samples), with the size and sha256 its part record gives, checked against the disk."""
    fmt = get_format(str(read_cache_json(out)["spec"]["format"]))
    if not isinstance(fmt, ShardFormat):
        raise PublishError(f"{relpath}: a ledger row names a member, but format {fmt.name} keeps no shard files")
    record = part_record(out, relpath, fmt)
    size = outdir.size(out, relpath)
    if size != record.bytes:
        problems.append(f"{relpath}: {size} bytes on disk, its part record says {record.bytes}")
    return LocalFile(relpath, record.bytes, record.sha256, "data", source=OutFile(outdir.root(out), relpath))


def build_manifest(out: Path, config: UploadConfig, target: Target) -> Manifest:
    """The manifest of OUT: the files its ledgers name and the rest of what the cache is (`cache_files`), nothing
    else in OUT. Raises PublishError when the cache is not whole (a file missing or of another size than its
    ledger row, an unsealed journal), or names a path outside OUT or a link (one line): nothing is published from a
    damaged cache."""
    out = outdir.root(out)
    try:
        if not outdir.is_file(out, CACHE_JSON):
            raise PublishError(f"{out} is not a latentforge cache (no {CACHE_JSON})")
        return _manifest(out, config, target, cache_files(out))
    except outdir.UnsafePath as exc:
        raise PublishError(f"{out}: nothing was uploaded: {exc}") from exc


def _manifest(out: Path, config: UploadConfig, target: Target, found: CacheFiles) -> Manifest:
    fingerprint = str(read_cache_json(out).get("fingerprint", ""))
    problems = [f"{p}: unsealed journal (a run is in progress or was killed: resume it first)" for p in found.journals]
    data = _data_files(out, problems)
    if problems:
        shown = "\n  ".join(problems[:20])
        raise PublishError(f"{out} is not whole; nothing was uploaded ({len(problems)} problem(s)):\n  {shown}")
    ledgers = [_on_disk(out, rel, "ledger") for rel in found.ledgers]
    reports = [_on_disk(out, rel, "report") for rel in found.reports]
    kept_specs = [_on_disk(out, rel, "report") for rel in found.kept_specs]  # replaced caches
    card = _card(out, config, target)
    manifest_file = _on_disk(out, CACHE_JSON, "manifest")
    if found.meta is not None:  # a shard format's index: after the shards it names
        ledgers.append(_on_disk(out, found.meta, "ledger"))
    everything = [*data, *reports, *kept_specs, card, *ledgers, manifest_file]
    chosen = [f for f in everything if _chosen(f, config)]
    chosen.sort(key=lambda f: (ROLE_ORDER[f.role], f.path))
    return Manifest(out, fingerprint, chosen, {f.path for f in everything}, len(everything) - len(chosen))


def _chosen(file: LocalFile, config: UploadConfig) -> bool:
    if file.role not in ("data", "report"):
        return True
    if config.include and not _matches(file.path, config.include):
        return False
    return not _matches(file.path, config.exclude)


def _card(out: Path, config: UploadConfig, target: Target) -> LocalFile:
    return card_file(out, target=target, license=config.license)


def gate_problems(out: Path, fingerprint: str) -> list[str]:
    """Why OUT may not be published yet, from its newest run report; [] when the gates passed.

    Passed means: a run report of this cache's fingerprint, reconciliation ok (or a shortfall accepted by a
    recorded decision), decode-and-verify not failed, and the audio gate (where the family has one) ok."""
    try:
        report = latest_run_report(out)
    except ReportError as exc:
        return [str(exc)]
    if report is None:
        return [f"no run report in {outdir.shown(out, REPORTS_DIR)}: build (or resume) the cache first"]
    problems = []
    if report.fingerprint != fingerprint:
        problems.append(
            f"the newest run report is of fingerprint {report.fingerprint[:16]}, the cache is {fingerprint[:16]}"
        )
    recon = report.reconciliation
    accepted = [d for d in report.decisions_at("loss") if d.choice == "accept_loss"]
    if recon is None:
        problems.append("the newest run report has no reconciliation (the run stopped before it)")
    elif not recon.ok and not accepted:
        problems.append(f"reconciliation found {recon.shortfall} sample(s) missing and nobody accepted the loss")
    if report.decode is not None and not report.decode.ok:
        problems.append("the decode gate failed in the newest run report")
    if report.audio is None and report.spec.get("audio"):
        problems.append("the newest run report has no audio gate (the run stopped before it)")
    elif report.audio is not None and not report.audio.ok:
        problems.append(f"the audio gate failed in the newest run report: {report.audio.headline}")
    return problems
