"""The audio gate (read only): for a spec with audio, every done sample's audio latent is loaded
(``weights_only``) and must hold a non-empty, finite tensor.

**No audio latent at all in an audio run is a hard failure**, whatever ``--on-loss`` says: that is the LTX-2
trainer's quiet failure (its audio decode catches the exception, logs at debug level, and the run trains
audio-free). The message names the likely cause (the audio decode path) and the first decode error recorded.
Clips without an audio track (or whose audio could not be decoded) are listed by name; they are also short in
reconciliation (the trainer's loader drops a sample that lacks a file in any source), where the loss gate
decides them. The gate holds for every mode with audio (`infra.models.base.role_kinds`: t2v and i2v with ``--audio``,
the ltx2-trainer recipe's default; a2v and v2a always). A spec without audio gets "not an audio run".
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from infra import outdir
from infra import report_files as reports
from infra.cache import ledger
from infra.cache.cachedir import read_cache_json
from infra.config import CacheSpec
from infra.formats import AUDIO_KIND, get_format
from infra.models import mode_roles, role_kinds

logger = logging.getLogger(__name__)
NO_TRACK = "no_audio_track"


@dataclass(frozen=True)
class NoAudio:
    """A done sample without an audio latent, and why (from its ledger row)."""

    id: str
    group: str
    shard: str
    reason: str
    detail: str


@dataclass
class AudioReport:
    """Audio latents of a cache's done samples."""

    out: str
    audio_run: bool
    done: int = 0
    with_audio: int = 0
    without: list[NoAudio] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    first_error: str | None = None

    @property
    def ok(self) -> bool:
        """Not an audio run, or at least one audio latent and none unreadable."""
        return not self.audio_run or (self.with_audio > 0 and not self.unreadable)

    @property
    def silent(self) -> bool:
        """An audio run in which not one done sample has an audio latent: silent clips, or a broken audio path."""
        return self.audio_run and bool(self.done) and self.with_audio == 0

    def headline(self, *, advice: bool = True) -> str:
        """One line: the verdict; for silent clips, with `advice`, what a build of them without audio takes (the
        build's own error says it as a command: `flows.audit`)."""
        if not self.audio_run:
            return "audio gate: not an audio run"
        if self.silent:
            cause = f"; first decode error: {self.first_error}" if self.first_error else ""
            rebuild = ". A set of silent clips trains without audio: rebuild with --skip-audio" if advice else ""
            return (
                f"audio gate: FAILED: not one of {self.done} done samples has an audio latent — the audio decode path "
                f"(PyAV on the clips' audio streams) produced nothing{cause}{rebuild}"
            )
        verdict = "OK" if self.ok else f"FAILED ({len(self.unreadable)} audio latent(s) unreadable or empty)"
        return (
            f"audio gate: {verdict}: {self.with_audio} of {self.done} done samples have audio, {len(self.without)} not"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "headline": self.headline()}

    def _sections(self) -> list[reports.Section]:
        return [
            ("Samples without audio", *reports.dataclass_rows(NoAudio, self.without)),
            ("Unreadable audio latents", ["file"], [[p] for p in self.unreadable]),
        ]

    def markdown(self) -> str:
        return reports.render_markdown(self.headline(), [f"cache `{self.out}`"], self._sections())

    def text(self) -> str:
        return reports.render_text(self.headline(), [f"cache {self.out}"], self._sections())


def audio_check(out: Path) -> AudioReport:
    """Load every done sample's audio latent; list the samples without one with the reason."""
    out = outdir.root(out)
    spec = CacheSpec.model_validate(read_cache_json(out)["spec"])
    audio_run = AUDIO_KIND in role_kinds(mode_roles(spec.mode), spec.audio)  # a mode with audio (a2v: --audio's say)
    report = AudioReport(str(out), audio_run)
    if not audio_run:
        return report
    fmt = get_format(spec.format, spec.family)
    key = fmt.keys[AUDIO_KIND]
    for shard, rows in ledger.read_all(out).items():
        for row in rows.values():
            if row.status != "done":
                continue
            report.done += 1
            file = row.file_of(AUDIO_KIND)
            if file is None:
                reason, _, detail = row.missing.get(AUDIO_KIND, f"{NO_TRACK}: no audio file recorded").partition(": ")
                report.without.append(NoAudio(row.id, row.group, shard, reason, detail))
                if reason != NO_TRACK and report.first_error is None:
                    report.first_error = f"{row.id}: {reason}: {detail}"
                continue
            try:
                value = fmt.read_file(out, file).get(key)
            except Exception as exc:  # noqa: BLE001 - an unreadable file is the finding
                report.unreadable.append(f"{file.path}: {type(exc).__name__}")
                continue
            if isinstance(value, torch.Tensor) and value.numel() > 0 and bool(torch.isfinite(value).all()):
                report.with_audio += 1
            else:
                report.unreadable.append(f"{file.path}: no finite, non-empty {key!r} tensor")
    logger.info("%s", report.headline())
    return report
