"""What a cache publishes: the manifest of local files, built from the ledgers (never from a directory walk
of the data), and the gate that says whether the cache may be published at all.

Roles: every done ledger row's file is ``data`` (size and sha256 from the ledger, checked against the disk);
``reports/`` is ``report`` (upload reports are left out: they describe a remote, not the cache); the dataset
card is ``card``; sealed ledgers are ``ledger``; ``cache.json`` is the ``manifest``, sent last.
``include``/``exclude`` globs narrow data and reports only: the manifest, ledgers and card always go,
so a remote holding one task family still says what the whole cache is.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from infra.audit.run_report import ReportError, latest_run_report
from infra.cache import ledger
from infra.cache.cachedir import CACHE_JSON, read_cache_json
from infra.config import UploadConfig
from infra.formats import ShardFormat, get_format
from infra.formats.shards import META_JSON, part_record
from infra.publish.base import ROLE_ORDER, LocalFile, PublishError, Role, Target
from infra.publish.card import card_file
from infra.reports import REPORTS_DIR, UNPUBLISHED_REPORTS
from infra.storage import TEMP_SUFFIX, sha256_file

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
    path = out / relpath
    return LocalFile(relpath, path.stat().st_size, sha256_file(path), role, source=path)


def _data_files(out: Path, problems: list[str]) -> list[LocalFile]:
    files: dict[str, LocalFile] = {}
    for shard, rows in ledger.read_all(out).items():
        for row in rows.values():
            if row.status != "done":
                continue
            for record in row.output_files():
                path = out / record.path
                if not path.is_file():
                    problems.append(f"{record.path}: done in ledger {shard} but not on disk")
                    continue
                if record.member is not None:  # a sample inside a shard file: the whole file goes, once
                    if record.path not in files:
                        files[record.path] = _shard_file(out, record.path, problems)
                    continue
                if path.stat().st_size != record.bytes:
                    problems.append(
                        f"{record.path}: {path.stat().st_size} bytes on disk, ledger {shard} says {record.bytes}"
                    )
                    continue
                seen = files.get(record.path)
                if seen is not None and seen.sha256 != record.sha256:
                    problems.append(f"{record.path}: two ledger rows with different sha256 (duplicate output)")
                files[record.path] = LocalFile(record.path, record.bytes, record.sha256, "data", source=path)
    return list(files.values())


def _shard_file(out: Path, relpath: str, problems: list[str]) -> LocalFile:
    """A shard file (many samples), with the size and sha256 its part record gives, checked against the disk."""
    fmt = get_format(str(read_cache_json(out)["spec"]["format"]))
    if not isinstance(fmt, ShardFormat):
        raise PublishError(f"{relpath}: a ledger row names a member, but format {fmt.name} keeps no shard files")
    record = part_record(out, relpath, fmt)
    path = out / relpath
    if path.stat().st_size != record.bytes:
        problems.append(f"{relpath}: {path.stat().st_size} bytes on disk, its part record says {record.bytes}")
    return LocalFile(relpath, record.bytes, record.sha256, "data", source=path)


def _tree(out: Path, directory: str, role: Role, skip: tuple[str, ...] = ()) -> list[LocalFile]:
    root = out / directory
    if not root.is_dir():
        return []
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name.endswith(TEMP_SUFFIX) or path.name.startswith(skip):
            continue
        found.append(_on_disk(out, path.relative_to(out).as_posix(), role))
    return found


def build_manifest(out: Path, config: UploadConfig, target: Target) -> Manifest:
    """The manifest of OUT; raises PublishError when the cache is not whole (a file missing or of another
    size than its ledger row, an unsealed journal): nothing is published from a damaged cache."""
    out = Path(out)
    if not (out / CACHE_JSON).is_file():
        raise PublishError(f"{out} is not a latentforge cache (no {CACHE_JSON})")
    fingerprint = str(read_cache_json(out).get("fingerprint", ""))
    problems = [
        f"{p.relative_to(out)}: unsealed journal (a run is in progress or was killed: resume it first)"
        for p in sorted(ledger.ledger_dir(out).glob("*.journal.jsonl"))
    ]
    data = _data_files(out, problems)
    if problems:
        shown = "\n  ".join(problems[:20])
        raise PublishError(f"{out} is not whole; nothing was uploaded ({len(problems)} problem(s)):\n  {shown}")
    ledgers = [f for f in _tree(out, ledger.LEDGER_DIR, "ledger") if not f.path.endswith(".journal.jsonl")]
    reports = _tree(out, REPORTS_DIR, "report", skip=UNPUBLISHED_REPORTS)
    kept_specs = [_on_disk(out, p.name, "report") for p in sorted(out.glob("cache.*.json"))]  # replaced caches
    card = _card(out, config, target)
    manifest_file = _on_disk(out, CACHE_JSON, "manifest")
    if (out / META_JSON).is_file():  # a shard format's index: after the shards it names
        ledgers.append(_on_disk(out, META_JSON, "ledger"))
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
        return [f"no run report in {Path(out) / REPORTS_DIR}: build (or resume) the cache first"]
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
