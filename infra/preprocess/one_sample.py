"""Gates before the full run: one real sample encoded, written to ``<OUT>.sanity/`` (never OUT), read back and
checked, with time and bytes projected for the whole plan (`run_sanity`); `infra.gates.disk` checks free space
against that projection.

Check failures come back as ``ok=False`` with problems; a model that cannot load raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch

from infra import outdir
from infra.cache import ledger, listing
from infra.cache.ledger import FileRecord
from infra.cache.listing import Planned
from infra.devices import resolve_device
from infra.errors import ConfigError, ConflictError, InputError
from infra.faults import fault_point
from infra.formats import EncodedSample, WrittenSample, get_format
from infra.formats.base import kind_dtype
from infra.formats.shards import SHARDS_DIR
from infra.job import Job
from infra.models import LoadedFamily, get_family
from infra.outstore import StoreOut
from infra.plan import ShardPlan, parse_only
from infra.preprocess.alone import tried_alone
from infra.preprocess.encode import encode_sample, load_encoder
from infra.preprocess.inflight import KILLED_RUN, InFlight
from infra.preprocess.kept import shard_samples
from infra.preprocess.resume import reusable, selected
from infra.report_files import human_bytes
from infra.runtime import machine_cache
from infra.sources import SampleRef, ShardReadError, open_source
from infra.sources.names import sample_name
from infra.storage import Written, atomic_write

logger = logging.getLogger("infra.preprocess.sanity")  # its name before the rename: the same log lines

T = TypeVar("T")

MARKER = ".latentforge-sanity"
#: The key of the sample a sanity is on, removed when it ends: left behind, that sample took the process down.
IN_PROGRESS = "in-progress"


class SanityDirError(ConflictError):
    """``<OUT>.sanity`` exists but latentforge did not make it: nothing is written there."""


@dataclass
class SanityReport:
    """One sample encoded, written, read back and checked, and the run it projects."""

    sample_key: str | None = None
    sample_id: str | None = None
    sample_group: str | None = None
    path: str | None = None
    seconds: float = 0.0  # decode + encode + write of one sample, model load excluded
    peak_memory_bytes: int = 0
    device: str = ""
    latent_shape: list[int] = field(default_factory=list)
    text_shape: list[int] = field(default_factory=list)
    latent_dtype: str = ""
    bucket: str | None = None  # WxHxF of the sample's bucket, where the spec has buckets
    text_dtype: str = ""
    #: What the format calls the latents and the text embeddings (pt: x0, text_embeds; ltx: latents,
    #: video_prompt_embeds): the sanity prints the names a user finds in the files.
    latent_key: str = "x0"
    text_key: str = "text_embeds"
    finite: bool = False
    round_trip: bool = False
    bytes: int = 0
    total_samples: int = 0
    #: Of those, the samples the run has left to encode (a resume: not done in OUT's ledger); the projection's count.
    left_samples: int = 0
    projected_seconds: float = 0.0
    projected_bytes: int = 0
    skipped_before: list[tuple[str, str]] = field(default_factory=list)
    nothing_to_encode: bool = False  # every planned sample is done: no model loaded, no media read
    #: Of the samples left, those in flight when a run died: the build decodes each alone in a child, not the sanity.
    suspects: int = 0
    ok: bool = False
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        data = asdict(self)
        data["skipped_before"] = [list(pair) for pair in self.skipped_before]
        return data

    def _rows(self) -> list[tuple[str, str]]:
        projected = human_bytes(self.projected_bytes)
        if self.nothing_to_encode and self.skipped_before:
            return [("sample", f"none usable left to encode: the others of the {self.total_samples} are done")]
        if self.nothing_to_encode and self.suspects:
            alone = "the build decodes each alone in a child process; the others are done"
            return [("sample", f"none to try here: {self.suspects} left were in flight when a run died ({alone})")]
        if self.nothing_to_encode:
            return [("sample", f"none to encode: all {self.total_samples} planned samples are done")]
        return [
            ("sample", sample_name(self.sample_group or "", self.sample_id) if self.sample_id else "none usable"),
            ("device", self.device),
            ("bucket", self.bucket or "—"),
            (self.latent_key, f"{self.latent_shape} {self.latent_dtype}"),
            (self.text_key, f"{self.text_shape} {self.text_dtype}"),
            ("finite / round trip", f"{self.finite} / {self.round_trip}"),
            ("seconds per sample", f"{self.seconds:.3f}"),
            ("peak memory", human_bytes(self.peak_memory_bytes)),
            ("bytes per sample", f"{self.bytes:,}"),
            ("projected", f"{self._left_text()}, {self.projected_seconds:,.1f} s, {projected}"),
        ]

    def _left_text(self) -> str:
        if self.left_samples == self.total_samples:
            return f"{self.total_samples} samples"
        return f"{self.left_samples} samples left to encode (of {self.total_samples}; the others are done)"

    def markdown(self) -> str:
        """A Prefect markdown artifact."""
        lines = [f"## Sanity: {'ok' if self.ok else 'FAILED'}", "", "| what | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in self._rows()]
        lines += ["", *[f"- problem: {p}" for p in self.problems]]
        lines += [f"- skipped `{key}`: {reason}" for key, reason in self.skipped_before]
        return "\n".join(lines)

    def text(self) -> str:
        """A few lines for a terminal."""
        lines = [f"sanity               {'ok' if self.ok else 'FAILED'}"]
        lines += [f"{k:<20} {v}" for k, v in self._rows()]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  skipped {key}: {reason}" for key, reason in self.skipped_before]
        return "\n".join(lines)


def sanity_dir(out: Path | StoreOut) -> Path:
    """``/cache/wan22`` → ``/cache/wan22.sanity`` (a sibling of OUT, never inside it). For an OUT in an object store,
    a folder of this machine's cache named by OUT's URL (``$LATENTFORGE_CACHE_DIR/sanity/<sha256>.sanity``): the
    sanity sample is scratch, kept on local disk."""
    if isinstance(out, StoreOut):
        name = hashlib.sha256(out.url.encode()).hexdigest()[:24]
        return machine_cache("sanity") / f"{name}.sanity"
    out = Path(out).expanduser().absolute()
    if not out.name:
        raise ConfigError(f"OUT {out} has no name: cannot place a sanity directory beside it")
    return out.with_name(out.name + ".sanity")


def prepare_sanity_dir(path: Path, *, create: bool = True) -> None:
    """Refuse (SanityDirError) a `path` that exists without the marker; else create it with its marker."""
    if path.exists() and not (path / MARKER).is_file():
        raise SanityDirError(
            f"{path} exists but has no {MARKER} file: it was not made by latentforge, so the sanity sample "
            "is not written there; move it away or pick another OUT"
        )
    if create and not (path / MARKER).is_file():
        path.mkdir(parents=True, exist_ok=True)
        note = b"scratch space of latentforge's sanity check; its files are replaced\n"
        atomic_write(path / MARKER, note, replace=True)


def _rss() -> int:
    return psutil.Process().memory_info().rss


@contextlib.contextmanager
def peak_memory(device: torch.device, interval: float = 0.02) -> Iterator[list[int]]:
    """Yields [peak bytes], set on exit: CUDA's allocator peak (weights included), else the peak growth of
    the process RSS, sampled by a background thread every `interval` seconds. Not more often: a thread that
    wakes every few ms contends for the GIL with the encoder's many small ops and slows it severalfold."""
    peak = [0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield peak
        finally:
            peak[0] = int(torch.cuda.max_memory_allocated(device))
        return
    base, stop = _rss(), threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            peak[0] = max(peak[0], _rss() - base)

    thread = threading.Thread(target=watch, name="sanity-rss", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], _rss() - base)


def _same(stored: object, tensor: torch.Tensor) -> bool:
    return isinstance(stored, torch.Tensor) and stored.dtype == tensor.dtype and torch.equal(stored, tensor)


def _record(written: Written, sample: WrittenSample) -> FileRecord:
    """A written file as a ledger's file record (relative to its own folder), a shard file's member included."""
    return FileRecord(path=written.path.name, bytes=written.bytes, sha256=written.sha256, member=sample.member)


def _check(sample: EncodedSample, written: WrittenSample, job: Job, report: SanityReport) -> None:
    """Shapes, dtypes, finiteness and the bit-exact round trip through the format's reader (every file)."""
    fmt = get_format(job.spec.format, job.spec.family)
    family, keys = job.spec.family, fmt.keys_for(job.spec.family)
    report.latent_key = fmt.label("latents", family)
    if "text_embeddings" in keys:
        report.text_key = fmt.label("text_embeddings", family)
    outputs = sample.outputs()
    latent = job.latent_shape
    if job.spec.buckets and sample.latents is not None:  # the planned shape is the sample's bucket's
        frames, height, width = sample.info["geometry"]
        latent = get_family(job.family).latent_shape(job.model_dir, frames, height, width)
    planned = {"latents": list(latent), "text_embeddings": list(job.text_shape)}
    if job.spec.text_storage == "trimmed":  # the prompt's rows only
        planned["text_embeddings"] = [sample.seq_len, *job.text_shape[1:]]
    text = sample.text_embeds
    report.latent_shape, report.text_shape = sample.latent_shape or [], list(text.shape) if text is not None else []
    report.latent_dtype = str(sample.latents.dtype) if sample.latents is not None else "-"  # "-": audio-only
    report.text_dtype = str(text.dtype) if text is not None else "-"
    report.finite = all(bool(torch.isfinite(t).all()) for t in outputs.values())
    records = {str(w.path): fmt.read_file(w.path.parent, _record(w, written)) for _, w in written.files}
    same = []
    for kind, tensor in outputs.items():
        path = next(str(w.path) for kinds, w in written.files if not kinds or kind in kinds)
        trimmed = kind == "text_embeddings" and fmt.trims_text_for(job.spec.family)
        kept = (tensor[: sample.seq_len] if trimmed else tensor).to(fmt.stored_dtype(kind, job.spec.store_dtype))
        same.append(kind not in keys or _same(records[path].get(keys[kind]), kept))
        name = fmt.label(kind, family)
        if kind in planned and list(tensor.shape) != planned[kind]:
            report.problems.append(f"{name} shape {list(tensor.shape)}, planned {planned[kind]}")
        if tensor.dtype != kind_dtype(kind, job.spec.store_dtype):
            report.problems.append(f"{name} dtype {tensor.dtype}, expected {kind_dtype(kind, job.spec.store_dtype)}")
    report.round_trip = all(same)
    if not report.finite:
        report.problems.append("non-finite values (nan or inf) in the encoded tensors")
    if not report.round_trip:
        report.problems.append(f"round trip through the {job.spec.format} reader is not bit-identical")


def _trying(
    report: SanityReport, job: Job, encoder: LoadedFamily, out: Path, repeats: int, suspect: str | None
) -> Callable[[SampleRef], Any]:
    """The sanity's attempt on one sample: encoded, written and timed; the report names the sample being tried
    (so an encode error names it) and keeps the time. The `suspect` (the sample the last sanity died on) is first
    decoded alone in a child (`infra.preprocess.alone.tried_alone`), untimed."""

    def attempt(ref: SampleRef) -> Any:
        report.sample_key = ref.key
        atomic_write(out / IN_PROGRESS, ref.key.encode(errors="surrogateescape"), replace=True)
        if ref.key == suspect and (killed := tried_alone(ref, job)) is not None:  # passed over on proof only
            raise InputError(KILLED_RUN, f"the last sanity died on it, and {killed} (the build tries it)")
        found, report.seconds = _timed(ref, job, encoder, out, repeats)
        fault_point("sanity")
        return found

    return attempt


def _timed(ref: SampleRef, job: Job, encoder: LoadedFamily, out: Path, repeats: int) -> tuple[Any, float]:
    """Decode + encode (the build's `encode_sample`) + write, `repeats` times: (sample, written),
    median s."""
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample = encode_sample(ref, job, encoder).sample
        fmt = get_format(job.spec.format, job.spec.family)
        if fmt.sharded:  # the scratch's shard files are replaced too (a writer continues after the parts it finds)
            shutil.rmtree(out / SHARDS_DIR, ignore_errors=True)
        with fmt.open_writer(out, job.spec, "sanity") as writer:
            written = writer.write(sample, replace=True)
        times.append(time.perf_counter() - start)
    return (sample, written), statistics.median(times)


@dataclass
class Scan:
    """What a pass over the plan's samples met before the one it stopped at: samples skipped (key, reason) and
    unreadable shards, and how many samples OUT's ledger has the sanity pass over: kept (a resume's done samples, and
    those proven to kill their decoder) and suspects (in flight when a run died: the build decodes them alone,
    `infra.preprocess.inflight`)."""

    skipped: list[tuple[str, str]] = field(default_factory=list)
    kept: int = 0
    suspects: int = 0


#: What `candidates` does with a planned sample: passes it over (not selected), counts it kept (done, or proven to kill
#: its decoder) or a suspect (the build's to decode alone), or tries it.
_PASS, _KEPT, _SUSPECT, _TRY = "pass", "kept", "suspect", "try"


def candidates(
    job: Job,
    shards: list[ShardPlan],
    scan: Scan,
    *,
    spool: Path | None = None,
    pending_only: bool = False,
) -> Iterator[SampleRef]:
    """The samples of the plan's `shards` in plan order (within each shard's quota), listed lazily; `pending_only`:
    only those the build would encode (the shard loop's rule, `resume.wanted`: selected by ``--only`` and not kept
    from OUT's ledger, those counted in `scan.kept`), and no suspect (counted in `scan.suspects`: the build decodes
    those alone in a child, `infra.preprocess.inflight`); an unreadable shard is added to `scan.skipped`. A shard the
    plan listed whole into its `spool` with no sample to try is not listed again (its kept samples counted from the
    plan's listing); a tar in a store the plan recorded is made from its records (`infra.preprocess.kept.
    shard_samples`), its headers not read again."""
    source = open_source(job.source, job.spec, job.limits)
    for shard, verdict in _verdicts(job, shards, pending_only):
        planned = _spooled(spool, shard)
        if planned is not None and all(verdict(key) != _TRY for key, _, _ in planned):
            scan.kept += sum(verdict(key) == _KEPT for key, _, _ in planned)
            scan.suspects += sum(verdict(key) == _SUSPECT for key, _, _ in planned)
            continue
        try:
            with contextlib.closing(shard_samples(shard, source, spool)) as samples:  # type: ignore[type-var]
                for ref in itertools.islice(samples, shard.quota):
                    found = verdict(ref.key)
                    if found == _KEPT:
                        scan.kept += 1
                    elif found == _SUSPECT:
                        scan.suspects += 1
                    elif found == _TRY:
                        yield ref
        except ShardReadError as exc:
            logger.warning("%s", exc)
            scan.skipped.append((shard.id, f"shard_unreadable: {exc}"))


@dataclass(frozen=True)
class _Rule:
    """What `candidates` does with a sample of one shard, by its key."""

    job: Job
    pending_only: bool
    keys: frozenset[str] | None  # ``--only``'s of the shard
    previous: dict[str, ledger.LedgerRow]
    died: InFlight

    def __call__(self, key: str) -> str:
        if self.keys is not None and not selected(key, self.keys):
            return _PASS
        row = self.previous.get(key)
        if self.pending_only and self.died.suspect(key, row):
            return _SUSPECT
        if self.pending_only and (reusable(row, self.job) or self.died.killed(key, row)):
            return _KEPT
        return _TRY


def _verdicts(job: Job, shards: list[ShardPlan], pending_only: bool) -> Iterator[tuple[ShardPlan, _Rule]]:
    """Each planned shard with the rule `candidates` applies to its samples (OUT's ledger read as it comes)."""
    selection = parse_only(job.selection.only) if pending_only else None
    for shard in shards:
        keys = selection.get(shard.id) if selection is not None else None
        marks: ledger.Marks = {}
        previous = ledger.read_shard(job.out, shard.id, marks) if pending_only and outdir.is_dir(job.out, "") else {}
        yield shard, _Rule(job, pending_only, keys, previous, InFlight(marks, keys))


def _spooled(spool: Path | None, shard: ShardPlan) -> list[Planned] | None:
    """The shard's samples as this run's plan listed them into its `spool` (up to its quota), where it listed them
    without damage; None: the source is listed (a plan that spools nothing, a damaged shard: its damage is met)."""
    if spool is None or shard.damage is not None:
        return None
    return listing.read_spooled(spool, shard.id)


def _left(job: Job, shards: list[ShardPlan], spool: Path | None) -> int:
    """The planned samples a resume still has to encode, by the shard loop's own rule (`candidates`): from the
    plan's listing and the ledgers (a shard it did not spool: a listing of the source), no media read."""
    left = 0
    for shard, verdict in _verdicts(job, shards, True):
        planned = _spooled(spool, shard)
        if planned is None:
            scan = Scan()
            left += sum(1 for _ in candidates(job, [shard], scan, pending_only=True)) + scan.suspects
        else:
            left += sum(verdict(key) in (_TRY, _SUSPECT) for key, _, _ in planned)
    return left


def _died_on(scratch: Path) -> str | None:
    """The sample an earlier sanity was on when its process died (it left its mark), or None."""
    try:
        return (scratch / IN_PROGRESS).read_bytes().decode(errors="surrogateescape") or None
    except OSError:
        return None


def first_usable(
    refs: Iterator[SampleRef], attempt: Callable[[SampleRef], T], skipped: list[tuple[str, str]]
) -> tuple[SampleRef, T] | None:
    """`attempt` on `refs` in order until one does not raise InputError: (that sample, what `attempt` returned),
    or None. Skipped samples are added to `skipped` as (key, reason). Any other error of `attempt` propagates."""
    for ref in refs:
        try:
            return ref, attempt(ref)
        except InputError as exc:
            logger.info("skipping %s (%s)", ref.key, exc)
            skipped.append((ref.key, exc.reason))
    return None


def dry_run(job: Job, shards: list[ShardPlan], spool: Path | None = None) -> dict[str, Any]:
    """The first usable sample of the plan's `shards` encoded in memory (nothing written): its shapes, dtypes and
    token counts."""
    encoder = load_encoder(job)
    scan = Scan()
    refs = candidates(job, shards, scan, spool=spool)
    found = first_usable(refs, lambda ref: encode_sample(ref, job, encoder), scan.skipped)
    skipped = scan.skipped
    if found is None:
        raise InputError("no_usable_sample", f"no sample could be encoded; skipped: {skipped}")
    _, encoded = found
    sample, text = encoded.sample, {"tokens_total": encoded.tokens_total, "truncated": encoded.truncated}
    fmt = get_format(job.spec.format, job.spec.family)
    tensors = {fmt.label(kind, job.spec.family): [list(t.shape), str(t.dtype)] for kind, t in sample.outputs().items()}
    return {
        "sample": sample_name(sample.group, sample.id),
        **tensors,
        "seq_len": sample.seq_len,
        "source_shape": sample.source_shape,
        "skipped_before": [f"{key}: {reason}" for key, reason in skipped],
        **text,
    }


def run_sanity(
    job: Job, shards: list[ShardPlan], spool: Path | None = None, repeats: int = 1, *, pending_only: bool = False
) -> SanityReport:
    """Encode, write to ``<OUT>.sanity``, read back and check the first usable sample of the plan's `shards` (listed
    into `spool`: `candidates`); project the run.

    `repeats` > 1 encodes and writes that same sample again and takes the median time (steadier on a busy
    machine). The model loads before the clock starts. `pending_only` (the build's gate): the first sample the
    build would encode; when OUT's ledger keeps every planned sample there is nothing to guard, and the report
    says so (ok, `nothing_to_encode`) without loading the model or reading media. Raises SanityDirError, or
    ModelLoadError."""
    scratch = sanity_dir(job.out)
    device = resolve_device(job.device)
    report = SanityReport(device=str(device), total_samples=sum(s.samples for s in shards))
    scan = Scan(skipped=report.skipped_before)
    refs = candidates(job, shards, scan, spool=spool, pending_only=pending_only)
    suspect = _died_on(scratch)  # tried alone in a child first: the last sanity's death blames it only on proof
    first = next(refs, None)  # a listing and the ledgers: on a finished cache, no media read and no model loaded
    if pending_only and first is None and (scan.kept or scan.suspects) and not scan.skipped:
        report.nothing_to_encode = report.ok = True
        report.suspects = scan.suspects
        logger.info("sanity: nothing to try of %d planned samples (%d suspects)", report.total_samples, scan.suspects)
        return report
    prepare_sanity_dir(scratch, create=False)  # refuse before the (slow) model load
    encoder = load_encoder(job)
    prepare_sanity_dir(scratch)
    try:
        with peak_memory(device) as peak:
            attempt = _trying(report, job, encoder, scratch, max(1, repeats), suspect)
            todo = itertools.chain([first] if first is not None else [], refs)
            found = first_usable(todo, attempt, report.skipped_before)
    except Exception as exc:  # a sample that cannot be encoded or written is the sanity's finding, not a crash
        logger.exception("sanity: %s could not be encoded or written", report.sample_key)
        report.problems.append(f"encode_error on {report.sample_key}: {type(exc).__name__}: {exc}")
        return report
    finally:  # the process lived through its attempts: no sample is left in progress
        (scratch / IN_PROGRESS).unlink(missing_ok=True)
    report.peak_memory_bytes = peak[0]
    if found is None:
        report.sample_key = None
        if pending_only and (scan.kept or scan.suspects):  # a resume's samples left unusable, or the build's
            report.nothing_to_encode = report.ok = True
            logger.info("sanity: no usable sample left to encode (%d skipped)", len(report.skipped_before))
            return report
        report.problems.append(f"no usable sample in the plan ({len(report.skipped_before)} skipped)")
        return report
    ref, (sample, written) = found
    report.sample_id, report.sample_group = ref.id, ref.group
    if (bucket := sample.info.get("geometry")) and job.spec.buckets:
        report.bucket = "x".join(str(n) for n in (bucket[2], bucket[1], bucket[0]))
    report.path = str(written.files[0][1].path)
    report.bytes = sum(w.bytes for _, w in written.files)
    _check(sample, written, job, report)
    report.left_samples = _left(job, shards, spool) if pending_only else report.total_samples
    report.projected_seconds = round(report.seconds * report.left_samples, 3)
    report.projected_bytes = report.bytes * report.left_samples
    report.ok = not report.problems
    logger.info(
        "sanity %s: %.3f s per sample, %d samples",
        "ok" if report.ok else "FAILED",
        report.seconds,
        report.total_samples,
    )
    return report
