"""Decode-and-verify (read only on the cache): decode stored latents with the family's VAE, re-derive the source
frames with the build's recipe, measure PSNR / SSIM, and show each sample as a side-by-side mp4 and a PNG strip.

Files go under ``OUT/reports/decode/`` (or `report_dir`): ``<group>/<id>.mp4|.png`` and ``report.json|.md``;
if any of those names exists, the run takes a new ``<UTC stamp>[-N]/`` subfolder. Nothing is overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from infra.audit import reports
from infra.audit.compare import compare
from infra.cache import ledger
from infra.cache.cachedir import read_cache_json
from infra.cache.ledger import LedgerRow, window_of
from infra.cache.storage import atomic_write
from infra.config import CacheSpec
from infra.devices import resolve_device, resolve_dtype
from infra.errors import ConfigError
from infra.formats import AUDIO_KIND, Format, get_format
from infra.media.audio import trainer_audio
from infra.models import LoadedFamily, load_family
from infra.models.identity import component_identity
from infra.models.memory import LoadOptions
from infra.ops import heap
from infra.ops.faults import fault_point
from infra.preprocess.prepare import prepare_video
from infra.sources import Shard, Source, is_safe_name, open_source

logger = logging.getLogger(__name__)

DECODE_DIR = "decode"


@dataclass(frozen=True)
class DecodedSample:
    """One verified sample: its metrics against the re-derived source and the files showing it."""

    id: str
    group: str
    path: str
    psnr: float
    ssim: float
    frames: int
    mp4: str
    png: str
    audio_mel_l1: float | None = None  # audio runs: mean |log-mel error| of the decoded audio latent (nats)


@dataclass(frozen=True)
class DecodeProblem:
    """A chosen sample that could not be verified, and why."""

    id: str
    group: str
    shard: str
    problem: str


@dataclass
class DecodeReport:
    """Per-sample PSNR/SSIM of decoded latents against their source; a gate only when `min_psnr` is set."""

    out: str
    model: str
    source: str
    report_dir: str
    min_psnr: float | None = None
    rows: list[DecodedSample] = field(default_factory=list)
    problems: list[DecodeProblem] = field(default_factory=list)

    @property
    def mean_psnr(self) -> float | None:
        return fmean(r.psnr for r in self.rows) if self.rows else None

    @property
    def mean_ssim(self) -> float | None:
        return fmean(r.ssim for r in self.rows) if self.rows else None

    @property
    def ok(self) -> bool:
        """Without `min_psnr` always True (numbers reported, not judged); with it, every chosen sample was
        verified (no problems, at least one) and every PSNR is at least `min_psnr`."""
        if self.min_psnr is None:
            return True
        return bool(self.rows) and not self.problems and all(r.psnr >= self.min_psnr for r in self.rows)

    @property
    def strip_paths(self) -> list[Path]:
        """The PNG strips (top row source, bottom row decoded), one per verified sample."""
        return [Path(r.png) for r in self.rows]

    def headline(self) -> str:
        """One line: the verdict and the means."""
        verdict = "REPORTED" if self.min_psnr is None else "OK" if self.ok else f"FAILED (min PSNR {self.min_psnr})"
        means = f"mean PSNR {_safe(self.mean_psnr, 2)} dB, mean SSIM {_safe(self.mean_ssim, 4)}"
        return f"decode-verify: {verdict} ({len(self.rows)} sample(s), {means}, {len(self.problems)} problem(s))"

    def table(self) -> list[dict[str, Any]]:
        """One JSON-safe row per verified sample, for a table artifact."""
        rows = [asdict(r) | {"psnr": _safe(r.psnr, 2), "ssim": _safe(r.ssim, 4)} for r in self.rows]
        return [{"sample": row.pop("id"), **row} for row in rows]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (an infinite PSNR, identical pixels, is the string "inf")."""
        data = asdict(self)
        for row in data["rows"]:
            row["psnr"] = _safe(row["psnr"])
        means = {"mean_psnr": _safe(self.mean_psnr), "mean_ssim": self.mean_ssim}
        return data | means | {"ok": self.ok, "strip_paths": [str(p) for p in self.strip_paths]}

    def markdown(self) -> str:
        return reports.render_markdown(self.headline(), self._intro(), self._sections())

    def text(self) -> str:
        return reports.render_text(self.headline(), self._intro(), self._sections())

    def _intro(self) -> list[str]:
        gate = "not judged (no min PSNR)" if self.min_psnr is None else f"every sample ≥ {self.min_psnr} dB"
        where = [f"cache {self.out}", f"model {self.model}", f"source {self.source}", f"files {self.report_dir}"]
        return [*where, f"PSNR/SSIM on [0, 1] pixels against the source re-derived with the recipe; gate: {gate}"]

    def _sections(self) -> list[reports.Section]:
        table = self.table()
        return [
            ("Samples", list(table[0]) if table else [], [list(row.values()) for row in table]),
            ("Problems", *reports.dataclass_rows(DecodeProblem, self.problems)),
        ]


def _safe(value: float | None, digits: int | None = None) -> float | str | None:
    """JSON-safe: an infinite PSNR (identical pixels) as "inf", optionally rounded."""
    if value is None or digits is None:
        return "inf" if value == float("inf") else value
    return "inf" if value == float("inf") else round(value, digits)


def choose_samples(rows: Iterable[LedgerRow], n: int | None) -> list[LedgerRow]:
    """Done rows only, spread over groups: round robin over the sorted groups, each group's rows sorted by path
    (then shard and key). Deterministic; `n=None` takes them all."""
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    by_group: dict[str, list[LedgerRow]] = {}
    for row in sorted((r for r in rows if r.status == "done"), key=lambda r: (r.path or "", r.shard, r.key)):
        by_group.setdefault(row.group, []).append(row)
    queues = [by_group[group] for group in sorted(by_group)]
    chosen = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    return chosen if n is None else chosen[:n]


@dataclass
class _Run:
    """What every sample of one run needs."""

    out: Path
    spec: CacheSpec
    fmt: Format
    folder: Path
    family: LoadedFamily
    report: DecodeReport
    metrics_device: torch.device  # CUDA when the VAE runs there (full-size SSIM is slow on CPU), else CPU

    def problem(self, row: LedgerRow, text: str) -> None:
        logger.warning("decode-verify %s/%s: %s", row.group, row.id, text)
        self.report.problems.append(DecodeProblem(row.id, row.group, row.shard, text))

    def verify(self, row: LedgerRow, read_media: Callable[[], bytes | None]) -> None:
        """Measure one sample and write its files; any failure (its source's bytes too) is recorded as a problem."""
        try:
            self.report.rows.append(self._measure(row, read_media))
            fault_point("verify")
        except Exception as exc:  # noqa: BLE001 - one sample's failure is data, the others go on
            self.problem(row, f"{type(exc).__name__}: {exc}")

    def _measure(self, row: LedgerRow, read_media: Callable[[], bytes | None]) -> DecodedSample:
        group, name = row.group or "ungrouped", Path(row.id).stem
        if not (is_safe_name(group) and is_safe_name(name)):
            raise ValueError(f"unsafe group or id for a report path: {row.group!r}/{row.id!r}")
        file = row.file_of("latents")
        path = (self.out / str(file.path if file else "")).resolve()
        if file is None or not path.is_relative_to(self.out.resolve()) or path == self.out.resolve():
            raise ValueError(f"the ledger's latents file {file and file.path!r} is not inside OUT")
        key = self.fmt.keys["latents"]
        record = self.fmt.read_file(self.out, file)  # weights_only (a shard file's member where the format has them)
        if not isinstance(record, dict) or not isinstance(record.get(key), torch.Tensor):
            raise ValueError(f"{path}: no {key} tensor in the stored sample")
        if (media := read_media()) is None:
            raise ValueError("the source sample has no video")
        prepared = prepare_video(media, self.spec, window_of(row)[1])
        source, fps = prepared.pixels[0], prepared.clip.fps  # the recipe's pixels, re-derived
        del prepared  # the clip's frames at source resolution: the pixels are all that is compared
        compared = compare(source, self.family.decode_chunks(record[key]), self.metrics_device)
        frames = int(source.shape[1])
        mp4, png = (self.folder / group / f"{name}{suffix}" for suffix in (".mp4", ".png"))
        atomic_write(mp4, compared.mp4)
        atomic_write(png, compared.strip_png())
        psnr, ssim = compared.score.psnr, compared.score.ssim
        mel_l1 = self._audio_error(row, media, frames / fps) if self.spec.audio else None
        logger.info("decode-verify %s/%s: PSNR %.2f dB, SSIM %.4f", row.group, row.id, psnr, ssim)
        sample = DecodedSample(row.id, row.group, str(file.path), psnr, ssim, frames, str(mp4), str(png))
        return dataclasses.replace(sample, audio_mel_l1=mel_l1)

    def _audio_error(self, row: LedgerRow, media: bytes, seconds: float) -> float | None:
        """Mean |log-mel difference| between the clip's audio front end and the decoded audio latent (the frames
        both have); None when the sample has no audio."""
        file = row.file_of(AUDIO_KIND)
        reference = trainer_audio(media, seconds) if file is not None else None
        if file is None or reference is None:
            return None
        latents = self.fmt.read_file(self.out, file)[self.fmt.keys[AUDIO_KIND]]
        decoded = self.family.decode_audio(latents)
        frames = min(decoded.shape[1], reference[0].shape[1])
        return float((decoded[:, :frames] - reference[0][:, :frames]).abs().mean())


def _run_folder(root: Path, chosen: list[LedgerRow]) -> Path:
    """`root` when none of this run's names exists there, else a new ``<UTC stamp>[-N]`` subfolder."""
    names = ["report.json", "report.md"] + [f"{r.group}/{r.id}{s}" for r in chosen for s in (".mp4", ".png")]
    if not any((root / name).exists() for name in names):
        return root
    stamp = reports.utc_stamp()
    for k in itertools.count(1):
        folder = root / (stamp if k == 1 else f"{stamp}-{k}")
        if not folder.exists():
            return folder
    raise AssertionError("unreachable")  # pragma: no cover


def _verify_shard(run: _Run, source: Source, shard: Shard, rows: list[LedgerRow]) -> None:
    """Walk the shard once, up to the last chosen key; rows not reached are problems."""
    wanted: dict[str, list[LedgerRow]] = {}
    for row in rows:  # a windows:K sample is found under its clip's key
        wanted.setdefault(window_of(row)[0], []).append(row)
    try:
        with contextlib.closing(source.samples(shard)) as samples:
            for ref in samples:
                for row in wanted.pop(ref.key, []):
                    run.verify(row, functools.cache(ref.read_media))
                if not wanted:
                    break
    except Exception as exc:  # noqa: BLE001 - a damaged or vanished shard: its unreached rows are problems
        for row in (r for group in wanted.values() for r in group):
            run.problem(row, f"shard {shard.id} could not be read up to the sample: {exc}")
        return
    for row in (r for group in wanted.values() for r in group):
        run.problem(row, f"not found in the source (shard {shard.id}, key {row.key!r})")


def _verify_all(run: _Run, source_spec: str, chosen: list[LedgerRow]) -> None:
    """Open the source once, then each chosen shard once; a source that cannot be listed is a problem per row."""
    try:
        source = open_source(source_spec)
        shards = {shard.id: shard for shard in source.shards()}
    except Exception as exc:  # noqa: BLE001 - a moved or unreadable source: every chosen row is a problem
        for row in chosen:
            run.problem(row, f"source {source_spec} cannot be listed: {exc}")
        return
    for shard_id, rows in itertools.groupby(sorted(chosen, key=lambda r: r.shard), key=lambda r: r.shard):
        if shard_id in shards:
            _verify_shard(run, source, shards[shard_id], list(rows))
        else:
            for row in rows:
                run.problem(row, f"shard {shard_id} is not in the source {source_spec}")


def decode_and_verify(
    out: Path,
    *,
    model_dir: Path | None = None,
    n: int | None = 4,
    device: str = "auto",
    dtype: str | None = None,
    min_psnr: float | None = None,
    report_dir: Path | None = None,
    source: str | None = None,
    options: LoadOptions | None = None,
) -> DecodeReport:
    """Decode `n` chosen samples of the cache at `out` (None: all) and measure them against their source; the
    VAE runs in `dtype` (None: the cache's own compute dtype).

    The model is `model_dir` or the cache's provenance ``model_path``; the source `source` (``KIND:PATH``) or
    its provenance ``source``. `options` are the memory options the model is loaded with (a build passes its own,
    so the family it already holds is reused, not loaded a second time). Raises when cache.json or the ledgers
    cannot be read or the model cannot load."""
    out = Path(out)
    meta = read_cache_json(out)
    spec, provenance = CacheSpec.model_validate(meta["spec"]), meta.get("provenance", {})
    model_path, source_spec = model_dir or provenance.get("model_path"), source or provenance.get("source")
    if not model_path or not source_spec:
        raise ConfigError(f"{out}/cache.json records no model path or source: pass model_dir and source")
    model = Path(model_path)
    chosen = choose_samples((r for rows in ledger.read_all(out).values() for r in rows.values()), n)
    folder = _run_folder(Path(report_dir) if report_dir else reports.reports_dir(out) / DECODE_DIR, chosen)
    report = DecodeReport(str(out), str(model), source_spec, str(folder), min_psnr)
    if chosen:
        heap.release_freed()  # a build's freed encode buffers back to the OS before decoding at full size
        if component_identity(model / "vae", spec.identity_scheme) != spec.model_identity.get("vae"):
            report.problems.append(DecodeProblem("*", "*", "*", f"the VAE in {model} is not the one of this cache"))
        target = resolve_device(device)
        family = load_family(model, spec.family, target, resolve_dtype(dtype or spec.compute_dtype), options)
        on = target if target.type == "cuda" else torch.device("cpu")
        _verify_all(_Run(out, spec, get_format(spec.format), folder, family, report, on), source_spec, chosen)
        order = {(r.group, r.id, r.path): i for i, r in enumerate(chosen)}
        report.rows.sort(key=lambda r: order.get((r.group, r.id, r.path), len(order)))
    files = {"report.json": reports.to_json_bytes(report.to_dict()), "report.md": report.markdown().encode()}
    for name, data in files.items():
        atomic_write(folder / name, data)
    logger.info("%s", report.headline())
    return report
