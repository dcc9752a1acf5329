"""Encode one shard: the plain function behind the preprocess task.

A shard resumes from its ledger: a sample whose row is done and whose file is still there is kept
without reading or decoding its video. Every sample ends as a ledger row; one sample's error never
stops its shard.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from infra.cache import ledger
from infra.cache.ledger import WINDOWS_KEY, FileRecord, LedgerRow
from infra.cache.storage import sha256_file
from infra.errors import DiskFull, InputError, LatentforgeError, ModelLoadError
from infra.formats import EncodedSample, Format, PerSampleWriter, Writer, WrittenSample, get_format
from infra.gates.disk import disk_full_message
from infra.gates.plan import BuildPlan, ShardPlan, parse_only
from infra.gates.stale import kept, refreshed, source_state
from infra.models import LoadedFamily
from infra.ops import preempt
from infra.ops.faults import fault_point
from infra.preprocess import handoff, phases, prefetch
from infra.preprocess.encode import encode_sample, load_encoder, prefetcher_for
from infra.preprocess.result import ShardResult
from infra.preprocess.windows import expand
from infra.sources import SampleRef, ShardReadError, open_source

if TYPE_CHECKING:
    from infra.preprocess.chunks import Chunk

logger = logging.getLogger(__name__)

RowCallback = Callable[[LedgerRow], None]
#: A shard whose first N encode attempts all fail is broken (model, device, bug), not its inputs: stop it.
FAIL_FAST_AFTER = 3


class ShardBroken(LatentforgeError, RuntimeError):
    """A shard's first encodes all failed: the model or the device is broken, not the inputs."""


def _adopt_ours(plan: BuildPlan, fmt: Format, existing: list[str], row: LedgerRow) -> LedgerRow | None:
    """Files at a sample's paths with no done row (an interrupted run wrote them): adopted, the row done, when every
    file is there and carries this spec's fingerprint; None when they are another's (nothing is adopted)."""
    try:
        records = {rel: fmt.read(plan.out / rel) for rel in existing}
        prints = {r.get("fingerprint") if isinstance(r, dict) else None for r in records.values()}
        theirs = "its fingerprint " + ", ".join(str(p) for p in sorted(prints, key=str))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is simply not ours
        prints, theirs = set(), f"not a sample file: it does not load ({type(exc).__name__})"
    if prints != {plan.fingerprint}:
        row.detail = (
            f"{existing[0]} exists and was not written by this spec ({theirs}; this spec's {plan.fingerprint}); "
            "not overwritten"
        )
        return None
    files = [
        FileRecord(path=rel, bytes=(plan.out / rel).stat().st_size, sha256=sha256_file(plan.out / rel))
        for rel in existing
    ]
    record = records[existing[0]]
    row.status, row.path, row.bytes, row.sha256 = "done", files[0].path, sum(f.bytes for f in files), files[0].sha256
    row.files = files if len(files) > 1 else []
    row.extra["adopted"] = True  # written by an interrupted run of this spec, not encoded now
    row.latent_shape, row.seq_len = record.get("latent_shape"), record.get("seq_len")
    row.source_shape = record.get("source_shape")
    return row


def _write(
    plan: BuildPlan, writer: Writer, sample: EncodedSample, existing: list[str], replace: bool
) -> tuple[WrittenSample, bool]:
    """Write the sample: (what was written, whether files left by an interrupted run were adopted). A format
    without a fingerprint in its files (the trainer's exact keys) adopts a file only when it holds exactly the
    bytes this run renders; any other file there is not overwritten (FileExistsError) unless `replace`."""
    if not existing or replace or not isinstance(writer, PerSampleWriter):
        return writer.write(sample, replace=replace), False
    rendered = writer.render(sample)
    same = {rel for _, rel, data in rendered if rel in existing and (plan.out / rel).read_bytes() == data}
    if same != set(existing):
        raise FileExistsError(f"{sorted(set(existing) - same)[0]} exists with other bytes: not overwritten")
    return writer.write_rendered(rendered, present=frozenset(same)), True


def process_sample(
    ref: SampleRef,
    plan: BuildPlan,
    writer: Writer,
    get_encoder: Callable[[], LoadedFamily],
    *,
    replace_stale: str | None = None,
) -> LedgerRow:
    """One sample → one ledger row (done / skipped with a reason / failed with the error); the row records the
    sample's source identity and every file written. `replace_stale` (the old file's sha256) re-encodes a sample
    whose source changed and replaces its files: approved at the stale gate."""
    start = time.perf_counter()
    row = LedgerRow(key=ref.key, id=ref.id, group=ref.group, shard="", status="failed", fingerprint=plan.fingerprint)
    row.source = ref.identity
    fmt = get_format(plan.spec.format)
    paths = fmt.paths(ref.stem, plan.kinds) if ref.stem else {}
    existing = sorted({rel for rel in paths.values() if (plan.out / rel).exists()})
    replace = replace_stale is not None
    if existing and not replace and fmt.has_fingerprint:
        adopted = _adopt_ours(plan, fmt, existing, row)
        if adopted is not None and len(existing) == len(set(paths.values())):
            return adopted
        if adopted is None and plan.replace_from is None:
            row.status, row.reason, row.path = "failed", "output_exists", existing[0]
            return row
        row.status, row.detail, replace = "failed", None, True  # approved overwrite, or ours but incomplete
    try:
        sample, text_info = handoff.take(ref, plan) or encode_sample(ref, plan, get_encoder)
        written, adopted_files = _write(plan, writer, sample, existing, replace or plan.replace_from is not None)
        if replace_stale is not None:
            row.extra["replaced_stale"] = replace_stale
        elif replace or (existing and plan.replace_from is not None and not adopted_files):
            row.extra["replaced"] = plan.replace_from
        if adopted_files:
            row.extra["adopted"] = True
        files = written.records(plan.out)
        row.status, row.path, row.sha256, row.member = "done", files[0].path, files[0].sha256, files[0].member
        row.bytes, row.files = sum(f.bytes for f in files), files if len(files) > 1 else []
        row.missing = dict(sample.info.get("missing_outputs") or {})
        row.source_shape, row.latent_shape, row.seq_len = sample.source_shape, sample.latent_shape, sample.seq_len
        row.tokens_total, row.truncated = text_info["tokens_total"], text_info["truncated"]
        row.extra["sampling"] = sample.info["sampling"]
    except InputError as exc:
        row.status, row.reason, row.detail = "skipped", exc.reason, exc.detail
    except (ModelLoadError, DiskFull):
        raise  # fails the shard (and so the run), not each sample
    except FileExistsError as exc:
        row.reason, row.detail = "output_exists", str(exc)
    except Exception as exc:
        logger.exception("sample %s failed", ref.key)
        row.reason, row.detail = "encode_error", f"{type(exc).__name__}: {exc}"
    row.seconds = round(time.perf_counter() - start, 4)
    return row


def _reusable(row: LedgerRow | None, plan: BuildPlan) -> bool:
    """Done for this fingerprint and every one of its files on disk at the ledger's size."""
    if row is None or row.status != "done" or row.fingerprint != plan.fingerprint:
        return False
    files, fmt = row.output_files(), get_format(plan.spec.format)
    return bool(files) and all(fmt.present(plan.out, f) for f in files)


def process_shard(
    plan: BuildPlan,
    shard: ShardPlan,
    on_row: RowCallback | None = None,
    run_id: str | None = None,
    chunk: Chunk | None = None,
) -> ShardResult:
    """Encode one shard's samples (up to its quota), journal each row, seal the ledger at the end.

    With ``config.only`` naming samples of this shard, only those are visited; every other row is kept.
    Each new row records `run_id` (the flow run that wrote it: `rerun --failed-only` selects by it).
    A `chunk` takes only its clips and seals only their rows, into its own ledger part (`infra.preprocess.chunks`:
    merged into the shard's ledger when the shard's chunks have ended)."""
    start = time.perf_counter()
    selection = parse_only(plan.config.only)
    keys = selection.get(shard.id) if selection is not None else None
    result = ShardResult(shard=shard.id)
    ledger_id = shard.id if chunk is None else chunk.ledger_id(shard.id)
    writer_id = shard.id if chunk is None else chunk.name(shard.id)
    previous = ledger.read_shard(plan.out, shard.id)
    if chunk is not None:
        previous.update(ledger.read_shard(plan.out, ledger_id))  # an interrupted run's part of this chunk
    rows: dict[str, LedgerRow] = dict(previous) if chunk is None else {}  # unvisited rows are kept (a chunk: merge)
    first, stop = (0, shard.quota) if chunk is None else (chunk.start, chunk.stop)
    get_encoder = functools.partial(load_encoder, plan)  # loads on first use only (cached per process)
    samples = open_source(plan.config.source).samples(shard.shard)
    state = (previous, rows, result, ledger.windows_by_clip(previous))
    if plan.config.text_offload:  # the prompts first, in a pass of their own; then the text encoder is parked
        wanted = functools.partial(_wanted, plan=plan, previous=previous, keys=keys)
        phases.text_first_of(
            plan, open_source(plan.config.source).samples(shard.shard), (first, stop), wanted, get_encoder
        )
    ahead = _prefetcher(plan, itertools.islice(samples, first, stop), previous, keys)
    with (
        preempt.cleanup(functools.partial(_seal_from_journal, plan, ledger_id)),
        ledger.Journal(plan.out, ledger_id) as journal,
        get_format(plan.spec.format).open_writer(plan.out, plan.spec, writer_id) as writer,
        prefetch.running(ahead),
    ):
        try:
            with contextlib.closing(samples):
                for clip in ahead if ahead is not None else itertools.islice(samples, first, stop):
                    if keys is not None and not _selected(clip.key, keys):
                        continue
                    if _visit_clip(clip, plan, writer, get_encoder, journal, state, keys, run_id, on_row):
                        break
        except ShardReadError as exc:
            logger.error("shard %s: %s", shard.id, exc)
            result.error = str(exc)
        except DiskFull as exc:
            _seal_what_is_done(plan, ledger_id, rows)
            raise DiskFull(disk_full_message(plan.out, str(exc)), exc.path) from exc
    ledger.seal(plan.out, ledger_id, rows.values())
    fault_point("shard")
    _tally(result, rows.values())
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def _prefetcher(
    plan: BuildPlan, refs: Iterator[SampleRef], previous: dict[str, LedgerRow], keys: frozenset[str] | None
) -> prefetch.Prefetcher | None:
    """The shard's read-ahead over the samples it will encode (not those kept from the ledger, nor the sanity's
    sample, which `handoff.take` reads and compares instead of decoding it)."""
    return prefetcher_for(plan, refs, functools.partial(_wanted, plan=plan, previous=previous, keys=keys))


def _wanted(ref: SampleRef, plan: BuildPlan, previous: dict[str, LedgerRow], keys: frozenset[str] | None) -> bool:
    """Whether the shard will encode `ref` (selected, not kept from the ledger, not the sanity's held sample)."""
    selected = keys is None or _selected(ref.key, keys)
    return selected and not _reusable(previous.get(ref.key), plan) and not handoff.holds(plan, ref)


def _visit_clip(
    clip: SampleRef,
    plan: BuildPlan,
    writer: Writer,
    get_encoder: Callable[[], LoadedFamily],
    journal: ledger.Journal,
    state: tuple[dict[str, LedgerRow], dict[str, LedgerRow], ShardResult, dict[str, list[LedgerRow]]],
    keys: frozenset[str] | None,
    run_id: str | None,
    on_row: RowCallback | None,
) -> bool:
    """Every sample (window) of one clip; True when a stop was asked for (SIGTERM, Ctrl-C): the shard ends there,
    after the sample in flight."""
    previous, rows, result, known_windows = state
    windows = expand(clip, plan, known_windows.get(clip.key, []))
    for ref in windows:
        if keys is not None and ref.key not in keys and clip.key not in keys:
            continue
        if preempt.requested():
            result.interrupted = preempt.requested()
            return True
        count = len(windows) if ref.window is not None else None
        row = _visit(ref, plan, writer, get_encoder, (previous, journal, result), result.shard, run_id, count)
        rows[ref.key] = row
        if on_row is not None:
            on_row(row)
    return False


def _seal_from_journal(plan: BuildPlan, shard_id: str) -> None:
    """Seal the shard from what its ledger and journal hold now (the process is ending at once)."""
    ledger.seal(plan.out, shard_id, ledger.read_shard(plan.out, shard_id).values())


def _seal_what_is_done(plan: BuildPlan, shard_id: str, rows: dict[str, LedgerRow]) -> None:
    """Seal on a full disk when there is room for the ledger; otherwise the journal stays (a rerun reads it)."""
    try:
        ledger.seal(plan.out, shard_id, rows.values())
    except DiskFull:
        logger.warning("shard %s: no room to seal its ledger; its journal is kept for the next run", shard_id)


def _selected(key: str, keys: frozenset[str]) -> bool:
    """Whether `--only` names clip `key` or one of its windows."""
    return key in keys or any(k.rpartition("@")[0] == key for k in keys)


def _visit(
    ref: SampleRef,
    plan: BuildPlan,
    writer: Writer,
    get_encoder: Callable[[], LoadedFamily],
    state: tuple[dict[str, LedgerRow], ledger.Journal, ShardResult],
    shard_id: str,
    run_id: str | None,
    windows: int | None,
) -> LedgerRow:
    """One sample of the shard: its done row kept (checked against the source), or encoded now and journalled
    (a window's row records how many windows its clip has)."""
    previous, journal, result = state
    row, replace = previous.get(ref.key), None
    if row is not None and _reusable(row, plan):
        row, replace = _resumed(row, ref, plan, f"{shard_id}/{ref.key}", result)
        if row is not previous[ref.key]:
            journal.append(row)
    if row is None or not _reusable(row, plan) or replace is not None:
        row = process_sample(ref, plan, writer, get_encoder, replace_stale=replace)
        row.shard = shard_id
        if run_id:
            row.extra["run_id"] = run_id
        if windows is not None:
            row.extra[WINDOWS_KEY] = windows
        journal.append(row)
        fault_point("sample")
        _count_new(result, row)
    return row


def _resumed(
    row: LedgerRow, ref: SampleRef, plan: BuildPlan, selector: str, result: ShardResult
) -> tuple[LedgerRow, str | None]:
    """A done sample on resume, checked against its source as listed now: (the row to keep, or None for "encode
    it again"; the old file's sha256 when an approved stale replacement re-encodes it)."""
    state, changed = source_state(row, ref)
    if state == "stale" and selector in plan.stale_replace:
        return row, row.sha256 or ""
    result.reused += 1
    if state == "refreshed":
        return refreshed(row, ref), None
    if state == "stale" and selector in plan.stale_keep:
        result.stale_kept += 1
        return kept(row, ref), None
    if state == "stale":  # changed after the stale gate looked: keep the output, the next run asks
        result.stale_undecided += 1
        logger.warning("%s changed in the source during this run (%s): kept as it was", selector, changed)
    return row, None


def _count_new(result: ShardResult, row: LedgerRow) -> None:
    """Count a row this run produced; stop a shard whose first encodes all fail (a broken model or device)."""
    adopted = bool(row.extra.get("adopted"))
    result.encoded += row.status == "done" and not adopted
    result.reused += adopted
    result.encode_errors += row.reason == "encode_error"
    if result.encoded == 0 and result.encode_errors >= FAIL_FAST_AFTER:
        raise ShardBroken(f"the first {FAIL_FAST_AFTER} encodes of shard {result.shard} failed: {row.detail}")


def _tally(result: ShardResult, rows: object) -> None:
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for row in rows:  # type: ignore[attr-defined]
        counts[row.status] += 1
        if row.reason:
            reasons[row.reason] += 1
        if row.status == "done":
            result.bytes += row.bytes or 0
    result.counts, result.reasons = dict(counts), dict(reasons)
