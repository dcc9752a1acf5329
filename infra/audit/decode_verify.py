"""Decode-and-verify (read only on the cache): decode stored latents with the family's VAE, re-derive the source
frames with the build's recipe, measure PSNR / SSIM, and show each sample as a side-by-side mp4 and a PNG strip.

Files go under ``OUT/reports/decode/`` (or `report_dir`): ``<stem>.mp4|.png`` and ``report.json|.md``, where the
stem is the sample's own output name (`stems.sample_stem`: ``<group>/<id>`` for VBVR, ``G-11/clip0/video`` for a
folder's ``G-11/clip0/video.mp4``), unique in the cache; if any of those names exists, the run takes a new
``<UTC stamp>[-N]/`` subfolder. Nothing is overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from PIL import Image

from infra import heap, outdir
from infra import report_files as reports
from infra.audit.compare import compare
from infra.audit.stems import sample_stem
from infra.cache import ledger
from infra.cache.cachedir import read_cache_json
from infra.cache.ledger import LedgerRow, window_of
from infra.config import CacheSpec
from infra.devices import resolve_device, resolve_dtype
from infra.errors import ConfigError
from infra.faults import fault_point
from infra.fetch import local_model
from infra.formats import AUDIO_KIND, Format, get_format
from infra.formats.consumers import normalised
from infra.media.temporal import frames_seconds
from infra.models import LoadedFamily, get_family, load_family
from infra.models.identity import component_identity
from infra.models.memory import LoadOptions
from infra.outstore import is_url
from infra.preprocess.prepare import prepare_video
from infra.sources import Shard, Source, open_source
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

DECODE_DIR = reports.DECODE_DIR
#: The decode report's markdown artifact, pictures included, stays under this many characters: Prefect's server
#: emits each artifact's data inside an event, and drops events over PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES
#: (1,500,000 by default); a third is left for the event's own fields and a margin.
ARTIFACT_BYTES = 1_000_000
#: Strips embedded in the artifact at most (more samples are listed with their files, not drawn).
MAX_EMBEDDED = 12


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
    stem: str = ""  # the sample's output stem: its files are <stem>.mp4 and <stem>.png
    audio_mel_l1: float | None = None  # audio runs: mean |log-mel error| of the decoded audio latent (nats)
    audio_mel_l1_channels: list[float] | None = None  # the same, per audio channel (stereo: left, right)
    mel_png: str | None = None  # audio runs: <stem>.mel.png, the source's log-mel above the decoded one


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
    def strip_paths(self) -> list[outdir.Out]:
        """The PNG strips (top row source, bottom row decoded), one per verified sample (a URL where OUT is one)."""
        return [outdir.root(r.png) for r in self.rows]

    def headline(self) -> str:
        """One line: the verdict and the means."""
        verdict = "REPORTED" if self.min_psnr is None else "OK" if self.ok else f"FAILED (min PSNR {self.min_psnr})"
        means = f"mean PSNR {_safe(self.mean_psnr, 2)} dB, mean SSIM {_safe(self.mean_ssim, 4)}"
        return f"decode-verify: {verdict} ({len(self.rows)} sample(s), {means}, {len(self.problems)} problem(s))"

    def table(self) -> list[dict[str, Any]]:
        """One JSON-safe row per verified sample, for a table artifact: the numbers first, the long paths last."""
        rows = []
        for r in self.rows:
            numbers = {"psnr": _safe(r.psnr, 2), "ssim": _safe(r.ssim, 4), "frames": r.frames}
            audio = {"mel_l1": _safe(r.audio_mel_l1, 4), "mel_l1_channels": _channels(r)} if self._audio else {}
            rows.append(numbers | audio | {"sample": r.stem or r.id, "group": r.group, "png": r.png, "mp4": r.mp4})
        return rows

    @property
    def _audio(self) -> bool:
        return any(r.audio_mel_l1 is not None for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (an infinite PSNR, identical pixels, is the string "inf")."""
        data = asdict(self)
        for row in data["rows"]:
            row["psnr"] = _safe(row["psnr"])
        means = {"mean_psnr": _safe(self.mean_psnr), "mean_ssim": self.mean_ssim}
        return data | means | {"ok": self.ok, "strip_paths": [str(p) for p in self.strip_paths]}

    def markdown(self) -> str:
        """The report for report.md: the tables, then each sample's strip (a link relative to the report)."""
        pictures = [(r, _relative(r.png, self.report_dir), _relative(r.mel_png, self.report_dir)) for r in self.rows]
        return reports.render_markdown(self.headline(), self._intro(), self._sections(short=True)) + _pictures(pictures)

    def artifact_markdown(self, max_chars: int = ARTIFACT_BYTES) -> str:
        """The report for the Prefect UI: the same tables, then up to `MAX_EMBEDDED` strips (and mel pictures) as
        small PNGs embedded as data URIs (a browser loads no ``file://`` picture from an ``http://`` page), each
        downscaled to fit its share of `max_chars`; a picture that does not fit is named, not drawn."""
        head = reports.render_markdown(self.headline(), self._intro(), self._sections(short=True))
        budget = max_chars - len(head) - 200 * len(self.rows) - 200
        drawn = self.rows[:MAX_EMBEDDED]
        share = max(0, budget // max(1, sum(1 + (r.mel_png is not None) for r in drawn)))
        pictures = [(r, self._embedded(r.png, share), self._embedded(r.mel_png, share)) for r in drawn]
        text = head + _pictures(pictures)
        if len(self.rows) > len(drawn):
            text += f"\n{len(self.rows) - len(drawn)} more strip(s) not drawn here: see {self.report_dir}\n"
        return text

    def _embedded(self, path: str | None, max_chars: int) -> str | None:
        """The PNG at `path` (below OUT or the report folder: read through the door) as a data URI of at most
        `max_chars`; None when there is none, or it cannot fit."""
        if path is None:
            return None
        base = self.out if _under(path, self.out) is not None else self.report_dir
        try:
            found = reports.png_data_uri(outdir.read_bytes(outdir.root(base), _rel_below(path, base)), max_chars)
        except (OSError, outdir.UnsafePath) as exc:  # a strip moved or removed since: named, not drawn
            logger.warning("decode-verify: %s not embedded: %s", path, exc)
            return None
        return found.uri if found else None

    def text(self) -> str:
        return reports.render_text(self.headline(), self._intro(), self._sections())

    def _intro(self) -> list[str]:
        gate = "not judged (no min PSNR)" if self.min_psnr is None else f"every sample ≥ {self.min_psnr} dB"
        where = [f"cache {self.out}", f"model {self.model}", f"source {self.source}", f"files {self.report_dir}"]
        return [*where, f"PSNR/SSIM on [0, 1] pixels against the source re-derived with the recipe; gate: {gate}"]

    def _sections(self, *, short: bool = False) -> list[reports.Section]:
        """Samples (numbers first, the sample's name last, `short`ened for a page: in full in the pictures'
        captions) and problems (the text last)."""
        name = reports.shorten if short else str
        header = ["psnr", "ssim", "frames", *(["mel_l1", "per channel"] if self._audio else []), "sample"]
        rows = [
            [_safe(r.psnr, 2), _safe(r.ssim, 4), r.frames]
            + ([_safe(r.audio_mel_l1, 4), " / ".join(f"{c:.4f}" for c in _channels(r))] if self._audio else [])
            + [name(r.stem or r.id)]
            for r in self.rows
        ]
        problems = [[name(p.id), p.shard, p.problem] for p in self.problems]
        return [("Samples", header, rows), ("Problems", ["sample", "shard", "problem"], problems)]


def _relative(path: str | None, root: str) -> str | None:
    """`path` relative to `root` where it lies inside it (report.md's links), else as it is."""
    if path is None:
        return None
    found = _under(path, root)
    return path if found is None else found


def _under(path: str, root: str) -> str | None:
    """`path` relative to `root` where it lies inside it, else None. A URL (OUT in a store) by its text: a `Path`
    would fold its ``//``."""
    if outdir.is_store(root) or outdir.is_store(path):
        prefix = root.rstrip("/") + "/"
        return path[len(prefix) :] if path.startswith(prefix) else None
    return Path(path).relative_to(root).as_posix() if Path(path).is_relative_to(root) else None


def _rel_below(path: str, root: str) -> str:
    """`path` relative to `root`; ValueError when it is not inside it (as `Path.relative_to`)."""
    found = _under(path, root)
    if found is None:
        raise ValueError(f"{path} is not below {root}")
    return found


def _pictures(pictures: list[tuple[DecodedSample, str | None, str | None]]) -> str:
    """One block per sample: its PSNR and SSIM (mel error) beside its name, the strip, the mel picture; a picture
    that is None is named by its file instead."""
    if not pictures:
        return ""
    lines = ["", "### Strips", "", "Top row: the source frames (first, middle, last); bottom row: what the latents "
             "decode to. Pictures in the UI are made small (and at most 256 colours) to fit the artifact; the "
             "full-size PNGs are in the files folder above."]  # fmt: skip
    for row, strip, mel in pictures:
        name = row.stem or row.id
        mel_text = f" · mel L1 {_fixed(row.audio_mel_l1, 4)}" if row.audio_mel_l1 is not None else ""
        lines += ["", f"**PSNR {_fixed(row.psnr, 2)} dB · SSIM {_fixed(row.ssim, 4)}{mel_text}** · `{name}`"]
        lines += ["", f"![strip {name}]({strip})" if strip else f"(strip not drawn here: {row.png})"]
        if row.mel_png is not None:
            lines += ["", f"![log-mel {name}]({mel})" if mel else f"(mel not drawn here: {row.mel_png})"]
    return "\n".join(lines) + "\n"


def _fixed(value: float | None, digits: int) -> str:
    """`value` with exactly `digits` decimals for a caption (0.5400, not 0.54); "inf" or "n/a" where there is none."""
    if value is None:
        return "n/a"
    return "inf" if value == float("inf") else f"{value:.{digits}f}"


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
    base: Path  # OUT, or the --report-dir given: the files are written below it through the door
    folder: str  # where below `base`
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
        stem = sample_stem(row, self.fmt)
        file = row.file_of("latents")
        if file is None:
            raise ValueError("the ledger names no latents file")
        path = self.out / file.path
        key = self.fmt.keys["latents"]
        # weights_only, through the door (a path outside OUT or a link is refused); a shard file's member where it has
        record = self.fmt.read_file(self.out, file)
        if not isinstance(record, dict) or not isinstance(record.get(key), torch.Tensor):
            raise ValueError(f"{path}: no {key} tensor in the stored sample")
        if (media := read_media()) is None:
            raise ValueError("the source sample has no video")
        prepared = prepare_video(media, self.spec, window_of(row)[1])
        source, fps = prepared.pixels[0], prepared.clip.fps  # the recipe's pixels, re-derived
        del prepared  # the clip's frames at source resolution: the pixels are all that is compared
        latents = normalised(record[key], self.spec, self.family)  # a raw-mean cache (FastVideo's Wan2.2)
        compared = compare(source, self.family.decode_chunks(latents), self.metrics_device)
        frames = int(source.shape[1])
        mp4 = self.write(f"{stem}.mp4", compared.mp4)
        png = self.write(f"{stem}.png", compared.strip_png())
        psnr, ssim = compared.score.psnr, compared.score.ssim
        logger.info("decode-verify %s/%s: PSNR %.2f dB, SSIM %.4f", row.group, row.id, psnr, ssim)
        sample = DecodedSample(row.id, row.group, str(file.path), psnr, ssim, frames, str(mp4), str(png), stem)
        mels = self._audio_mels(row, media, frames_seconds(self.spec, frames, fps)) if self.spec.audio else None
        if mels is None:
            return sample
        mel_png = self.write(f"{stem}.mel.png", mel_picture(*mels))
        error = (mels[1] - mels[0]).abs()
        channels = [round(float(c.mean()), 6) for c in error]
        return dataclasses.replace(
            sample, audio_mel_l1=float(error.mean()), audio_mel_l1_channels=channels, mel_png=str(mel_png)
        )

    def write(self, name: str, data: bytes) -> Path:
        """A new file of this run's folder, through the door (never through a link, never over a file)."""
        return atomic_write(outdir.join(self.folder, name), data, out=self.base).path

    def _audio_mels(self, row: LedgerRow, media: bytes, seconds: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The clip's log-mel from the family's audio front end and the one its audio latent decodes to, per channel,
        over the frames both have ([C, T, M] each); None when the sample has no audio."""
        file = row.file_of(AUDIO_KIND)
        reference = self.family.audio_reference(media, seconds) if file is not None else None
        if file is None or reference is None:
            return None
        latents = self.fmt.read_file(self.out, file)[self.fmt.keys[AUDIO_KIND]]
        decoded = self.family.decode_audio(latents)
        frames = min(decoded.shape[1], reference.shape[1])
        return reference[:, :frames].float(), decoded[:, :frames].float()


def _channels(row: DecodedSample) -> list[float]:
    """The per-channel mel errors of a row (none recorded: [])."""
    return list(row.audio_mel_l1_channels or [])


def mel_picture(reference: torch.Tensor, decoded: torch.Tensor, scale: int = 2) -> bytes:
    """A PNG of two log-mels [C, T, M] (channels averaged): the source's above the decoded one, time to the right,
    low frequencies at the bottom, one grey scale for both (black: the lowest value of either), each pixel
    `scale` × `scale`."""
    pair = [m.mean(0).T.flip(0) for m in (reference, decoded)]  # (M, T), row 0 the highest band
    low, high = min(float(m.min()) for m in pair), max(float(m.max()) for m in pair)
    gap = torch.full((2, pair[0].shape[1]), high)  # a white line between the two
    grey = (torch.cat([pair[0], gap, pair[1]]) - low) / max(high - low, 1e-6) * 255
    pixels = grey.round().clamp(0, 255).to(torch.uint8).repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def _run_folder(base: Path, root: str, chosen: list[LedgerRow], fmt: Format) -> str:
    """`root` (below `base`) when none of this run's names exists there, else a new ``<UTC stamp>[-N]`` subfolder;
    looked up through the door (a link there is refused, not followed)."""
    stems = [sample_stem(r, fmt) for r in chosen]
    names = ["report.json", "report.md"] + [f"{stem}{s}" for stem in stems for s in (".mp4", ".png", ".mel.png")]
    if not any(outdir.lstat(base, outdir.join(root, name)) is not None for name in names):
        return root
    stamp = reports.utc_stamp()
    for k in itertools.count(1):
        folder = outdir.join(root, stamp if k == 1 else f"{stamp}-{k}")
        if outdir.lstat(base, folder) is None:
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
        source = open_source(source_spec, run.spec)
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

    The model is `model_dir` or the cache's provenance ``model_path`` (a URL: fetched, `infra.fetch`); the source
    `source` (``KIND:PATH``) or its provenance ``source``. `options` are the memory options the model is loaded with
    (a build passes its own, so the family it already holds is reused, not loaded a second time). Raises when
    cache.json or the ledgers cannot be read or the model cannot load."""
    out = outdir.root(out)
    meta = read_cache_json(out)
    spec, provenance = CacheSpec.model_validate(meta["spec"]), meta.get("provenance", {})
    model_path, source_spec = model_dir or provenance.get("model_path"), source or provenance.get("source")
    if not model_path or not source_spec:
        raise ConfigError(f"{out}/cache.json records no model path or source: pass model_dir and source")
    named = str(model_path)  # a model by URL (the provenance of a build with --model s3://...): fetched as a build does
    model = local_model(named, get_family(spec.family).components_for(True)) if is_url(named) else Path(model_path)
    chosen = choose_samples((r for rows in ledger.read_all(out).values() for r in rows.values()), n)
    if "latents" not in get_family(spec.family).kinds(spec):  # an audio-only mode: no video to decode
        logger.info("decode-verify: --mode %s has no video latents; nothing decoded", spec.mode)
        chosen = []
    fmt = get_format(spec.format, spec.family)
    base, root = (Path(report_dir), "") if report_dir else (out, f"{reports.REPORTS_DIR}/{DECODE_DIR}")
    folder = _run_folder(base, root, chosen, fmt)
    shown = named if is_url(named) else str(model)
    report = DecodeReport(str(out), shown, source_spec, outdir.shown(base, folder), min_psnr)
    if chosen:
        heap.release_freed()  # a build's freed encode buffers back to the OS before decoding at full size
        if component_identity(model / "vae", spec.identity_scheme) != spec.model_identity.get("vae"):
            report.problems.append(DecodeProblem("*", "*", "*", f"the VAE in {model} is not the one of this cache"))
        target = resolve_device(device)
        family = load_family(model, spec.family, target, resolve_dtype(dtype or spec.dtype), options)
        on = target if target.type == "cuda" else torch.device("cpu")
        _verify_all(_Run(out, spec, fmt, base, folder, family, report, on), source_spec, chosen)
        order = {(r.group, r.id, r.path): i for i, r in enumerate(chosen)}
        report.rows.sort(key=lambda r: order.get((r.group, r.id, r.path), len(order)))
    files = {"report.json": reports.to_json_bytes(report.to_dict()), "report.md": report.markdown().encode()}
    for name, data in files.items():
        atomic_write(outdir.join(folder, name), data, out=base)
    logger.info("%s", report.headline())
    return report
