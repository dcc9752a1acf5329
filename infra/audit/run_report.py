"""The run report: one JSON file per build run, ``OUT/reports/run-<UTC>.json``, never overwritten.

It says what was built from what, with which model and spec, what came out, what each gate found and who
decided what. It is a typed record (`RunReport`): what reads it back (the upload gate, the card, `rerun`)
gets a validated model, and a missing or unknown key is an error, never a silent default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infra import outdir, records
from infra.errors import LatentforgeError
from infra.gates.decision import Decision
from infra.job import Job
from infra.outstore import is_url
from infra.plan import ShardPlan
from infra.report_files import REPORTS_DIR, report_order, to_json_bytes, write_new

logger = logging.getLogger(__name__)

RUN_PREFIX = "run"
RUN_REPORT_VERSION = 2
#: Summary fields that become the run report's counts.
#: The config fields a run report leaves out, by section: tokens are approvals, not settings; a webhook URL may hold a
#: secret (the flow records `settings_record` of its plan).
HIDDEN_SETTINGS: dict[str, Any] = {"gates": {"approve_overwrite"}, "upload": {"approve_replace"}, "alerts": {"webhook"}}
COUNT_FIELDS = ("samples", "done", "skipped", "failed", "encoded", "reused", "stale_kept", "stale_undecided", "bytes")


class ReportError(LatentforgeError):
    """A report that cannot be read as what it claims to be."""


class Record(BaseModel):
    """Base of the report records: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class ModelRecord(Record):
    path: str
    family: str
    identity: dict[str, str]


class ShardRecord(Record):
    id: str
    quota: int | None
    samples: int


class ReconcileRecord(Record):
    """`ReconcileReport.to_dict()`: expected against produced, every missing sample with its reason."""

    out: str
    source: str
    fingerprint: str
    format: str
    kinds: list[str]
    max_length: int
    groups: dict[str, dict[str, Any]]
    missing: list[dict[str, Any]]
    truncated: list[dict[str, Any]]
    shard_problems: dict[str, str]
    unlisted: int
    gone_from_source: list[dict[str, Any]]
    unowned: list[str] = []  # files its consumer would load that no row owns (reports before it: none recorded)
    expected: int
    produced: int
    shortfall: int
    ok: bool
    reasons: dict[str, int]


class DecodeRecord(Record):
    """`DecodeReport.to_dict()`: PSNR/SSIM per decoded sample, and whether the gate passed."""

    out: str
    model: str
    source: str
    report_dir: str
    min_psnr: float | None
    rows: list[dict[str, Any]]
    problems: list[dict[str, Any]]
    mean_psnr: float | str | None
    mean_ssim: float | None
    ok: bool
    strip_paths: list[str]


class AudioRecord(Record):
    """`AudioReport.to_dict()`: audio latents present, the samples without one and why, the verdict."""

    out: str
    audio_run: bool
    done: int
    with_audio: int
    without: list[dict[str, Any]]
    unreadable: list[str]
    first_error: str | None
    ok: bool
    headline: str


class RunReport(Record):
    """One build run, as recorded in ``OUT/reports/run-<UTC>.json``."""

    report: Literal["latentforge-run"] = "latentforge-run"
    report_version: Literal[2] = RUN_REPORT_VERSION
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    flow_run_id: str | None
    out: str
    source: str
    model: ModelRecord
    spec: dict[str, Any]
    fingerprint: str
    config: dict[str, Any]
    shards: list[ShardRecord]
    counts: dict[str, int | None]
    reasons: dict[str, int]
    shard_errors: dict[str, str]
    timings: dict[str, float]
    reconciliation: ReconcileRecord | None
    decode: DecodeRecord | None
    audio: AudioRecord | None
    decisions: list[Decision]
    versions: dict[str, str | None]
    #: A store's transient errors retried, by kind (`infra.sources.retries`); absent (None) where the run read no
    #: store (a local build's report is as it was).
    store_retries: dict[str, int] | None = None
    #: The clips a display matrix turns (``clips``: ``group/id`` → degrees counter-clockwise), what the run did with
    #: them (``rotate``) and the flag that changes it (``change``); absent (None) where no clip has one.
    rotated: dict[str, Any] | None = None

    def decisions_at(self, gate: str) -> list[Decision]:
        """The decisions recorded at one gate, in the order they were made."""
        return [d for d in self.decisions if d.gate == gate]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Installed versions of latentforge and the libraries that decide the bytes or run the flow."""
    names = ("latentforge", "torch", "prefect", "diffusers", "transformers", "av", "pillow", "opencv-python-headless")
    return {name: _version(name) for name in names}


def run_report(
    job: Job,
    shards: list[ShardPlan],
    summary: Mapping[str, Any],
    *,
    settings: Mapping[str, Any],
    reconciliation: Mapping[str, Any] | None,
    decode: Mapping[str, Any] | None,
    decisions: list[Decision],
    audio: Mapping[str, Any] | None = None,
    timings: Mapping[str, float],
    flow_run_id: str | None = None,
) -> RunReport:
    """The run report of `job` over the plan's `shards`: `settings` is the run's config as recorded (JSON, without
    `HIDDEN_SETTINGS`), `summary` a `BuildSummary.model_dump()`, `reconciliation` a `ReconcileReport.to_dict()`,
    `decode` a `DecodeReport.to_dict()`, `timings` seconds per step."""
    return RunReport(
        flow_run_id=flow_run_id,
        out=str(job.out),
        source=job.source,
        model=ModelRecord(path=job.model, family=job.family, identity=dict(job.spec.model_identity)),
        spec=job.spec.model_dump(mode="json"),
        fingerprint=job.fingerprint,
        config=dict(settings),
        shards=[ShardRecord(id=s.id, quota=s.quota, samples=s.samples) for s in shards],
        counts={name: summary.get(name) for name in COUNT_FIELDS},
        reasons=dict(summary.get("reasons") or {}),
        shard_errors=dict(summary.get("shard_errors") or {}),
        timings={step: round(float(seconds), 3) for step, seconds in timings.items()},
        reconciliation=ReconcileRecord.model_validate(reconciliation) if reconciliation is not None else None,
        decode=DecodeRecord.model_validate(decode) if decode is not None else None,
        audio=AudioRecord.model_validate(audio) if audio is not None else None,
        decisions=list(decisions),
        versions=versions(),
        store_retries=dict(summary.get("store_retries") or {}) if _reads_a_store(job) else None,
        rotated=_rotated(summary.get("rotated") or {}),
    )


def _rotated(rotated: Mapping[str, Any]) -> dict[str, Any] | None:
    """The report's record of the rotated clips (None without any)."""
    if not rotated.get("clips"):
        return None
    rotate = rotated.get("rotate") or "stored"
    return {"rotate": rotate, "change": "--rotate " + ("auto" if rotate == "stored" else "stored"), **rotated}


def _reads_a_store(job: Job) -> bool:
    """True when the run's source (``KIND:PATH``), model or OUT is a URL."""
    return is_url(job.source.partition(":")[2]) or is_url(job.model) or is_url(str(job.out))


def write_run_report(out: Path, report: RunReport) -> Path:
    """``OUT/reports/run-<UTC stamp>[-N].json`` (sorted keys); a new file per call, never an overwrite."""
    unused = {"store_retries"} if report.store_retries is None else None
    body = {".json": to_json_bytes(report.model_dump(mode="json", exclude=unused))}
    (path,) = write_new(REPORTS_DIR, RUN_PREFIX, body, out=out)
    return path


def read_run_report(path: Path) -> RunReport:
    """One run report (``OUT/reports/<name>``, read through the door: a link is refused), validated; ReportError
    names the file and what is wrong with it."""
    try:
        data = outdir.read_bytes(path.parent.parent, f"{REPORTS_DIR}/{path.name}")
        value = records.loads(data, str(path), "a run report")
        return records.model(RunReport, value, str(path), "a run report of this version")
    except records.DamagedRecord as exc:  # one line: the file and why
        raise ReportError(str(exc)) from None
    except (OSError, ValueError, outdir.UnsafePath) as exc:
        raise ReportError(" ".join(f"{path}: unreadable ({exc})".split())) from exc


def run_report_paths(out: Path) -> list[Path]:
    """Every run report under OUT, oldest first (by name: timestamp, then collision number)."""
    names = [e.name for e in outdir.entries(out, REPORTS_DIR) if e.name.endswith(".json")]
    root = outdir.root(out)  # a folder, or a store's URL (its reports' paths are URLs too)
    named = [(key, root / REPORTS_DIR / name) for name in names if (key := report_order(Path(name), RUN_PREFIX))]
    return [p for _, p in sorted(named)]


def latest_run_report(out: Path) -> RunReport | None:
    """The newest run report under OUT, or None if there is none.

    Raises ReportError when the newest one cannot be read: an older report is never silently used instead."""
    paths = run_report_paths(out)
    return read_run_report(paths[-1]) if paths else None


def newest_run_report(out: Path, wanted: Callable[[RunReport], bool]) -> tuple[RunReport, Path] | None:
    """The newest run report under OUT that `wanted` accepts, and its path; None when none does. Unreadable or
    older-version reports are passed over with a warning (`latest_run_report` is the one that refuses them)."""
    for path in reversed(run_report_paths(out)):
        try:
            report = read_run_report(path)
        except ReportError as exc:
            logger.warning("%s", exc)
            continue
        if wanted(report):
            return report, path
    return None


def run_report_of(out: Path, flow_run_id: str) -> RunReport | None:
    """The run report a flow run wrote in OUT, or None (it stopped before its audit)."""
    found = newest_run_report(out, lambda report: report.flow_run_id == flow_run_id)
    return found[0] if found else None
