"""Encode one shard: the loop behind the preprocess task.

A sample's trip, one module a stage, each handing one type to the next:

    SampleRef ─read─▶ RawSample ─prepare─▶ PreparedSample ─encode─▶ Encoded ─write─▶ WrittenFiles ─record─▶ LedgerRow

The shard's read-ahead (`prefetch`) runs read and prepare ahead of the loop. A shard resumes from its ledger: a
sample whose row is done and whose file is still there is kept without reading or decoding its video. Every sample
ends as a ledger row; one sample's error never stops its shard, but a shard whose first encodes all fail does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from infra import outdir
from infra.cache import ledger
from infra.cache.ledger import WINDOWS_KEY, LedgerRow
from infra.devices import bind_thread, pin_cpu_threads
from infra.errors import InputError, LatentforgeError, ModelLoadError, OutWriteError
from infra.faults import fault_point
from infra.formats import PerSampleWriter, Writer, get_format
from infra.gates.disk import stopping_message
from infra.job import Job
from infra.media.prompts import CaptionRules
from infra.models import LoadedFamily
from infra.ops import preempt
from infra.outdir import UnsafePath
from infra.outstore import StoreOut
from infra.plan import ShardPlan, parse_only
from infra.preprocess import phases, resume, write
from infra.preprocess import record_row as record
from infra.preprocess.alone import ChildKilled, prepare_alone
from infra.preprocess.chunks import Chunk
from infra.preprocess.decoders import decoding_team
from infra.preprocess.encode import encode, load_encoder, shard_state
from infra.preprocess.inflight import KILLED_RUN, PROOF, InFlight, blamed_detail
from infra.preprocess.kept import kept_listing, shard_samples
from infra.preprocess.prefetch import read_ahead
from infra.preprocess.prepare import PreparedSample, prepare
from infra.preprocess.puts import Commits, Pending, put_ended
from infra.preprocess.read import read
from infra.preprocess.shape_batches import ShapeBatches
from infra.preprocess.shard_result import ShardResult
from infra.preprocess.state import RunState, ShardState
from infra.preprocess.timing import stage_timing
from infra.preprocess.unvisited import unvisited_rows
from infra.preprocess.windows import expand
from infra.sources import SampleRef, ShardReadError, open_source, retries

logger = logging.getLogger(__name__)

RowCallback = Callable[[LedgerRow], None]
#: A shard whose first N encode attempts all fail is broken (model, device, bug), not its inputs: stop it.
FAIL_FAST_AFTER = 3


class ShardBroken(LatentforgeError, RuntimeError):
    """A shard's first encodes all failed: the model or the device is broken, not the inputs."""


@dataclass
class _Loop:
    """What the loop's visits share within one shard (or chunk)."""

    job: Job
    shard: ShardPlan
    chunk: Chunk | None
    writer: Writer
    journal: ledger.Journal
    get_encoder: Callable[[], LoadedFamily]
    state: ShardState
    previous: dict[str, LedgerRow]
    rows: dict[str, LedgerRow]
    result: ShardResult
    keys: frozenset[str] | None
    run_id: str | None
    on_row: RowCallback | None
    inflight: InFlight
    commits: Commits | None = None  # every visit's row committed in order (`infra.preprocess.puts`)
    background: bool = False  # a sample's files are put on the pool of `commits` (an OUT in an object store)
    spool: Path | None = None  # the plan's listing (`infra.preprocess.kept`)

    @property
    def shard_id(self) -> str:
        return self.shard.id

    @property
    def ledger_id(self) -> str:
        return self.shard.id if self.chunk is None else self.chunk.ledger_id(self.shard.id)


def process_shard(
    job: Job,
    shard: ShardPlan,
    on_row: RowCallback | None = None,
    run_id: str | None = None,
    chunk: Chunk | None = None,
    run: RunState | None = None,
    listing: Path | None = None,
) -> ShardResult:
    """Encode one shard's samples (up to its quota), journal each row, seal the ledger at the end.

    With ``config.selection.only`` naming samples of this shard, only those are visited; every other row is kept.
    Each new row records `run_id` (the flow run that wrote it: `rerun --failed-only` selects by it).
    A `chunk` takes only its clips and seals only their rows, into its own ledger part (`infra.preprocess.chunks`:
    merged into the shard's ledger when the shard's chunks have ended). `run` is the run's state (its stop check);
    a shard run alone gets its own. A planned sample the task does not visit gets its row (`infra.preprocess.
    unvisited`); a task that crashes seals what it has, those rows included, and raises the crash again. `listing`:
    the plan's spool of what it listed (a shard with nothing to encode is not listed again: `infra.preprocess.kept`)."""
    start = time.perf_counter()
    pin_cpu_threads(job.device)  # this thread encodes the shard (its text phase too): same bytes anywhere
    bind_thread(job.device)  # cuda:N placed: this thread's events and memory counters are that GPU's
    selection = parse_only(job.selection.only)
    keys = selection.get(shard.id) if selection is not None else None
    result = ShardResult(shard=shard.id, device=job.device)
    logger.info("shard %s on device %s", shard.id, result.device)
    ledger_id = shard.id if chunk is None else chunk.ledger_id(shard.id)
    writer_id = shard.id if chunk is None else chunk.name(shard.id)
    marks: ledger.Marks = {}
    previous = ledger.read_shard(job.out, shard.id, marks if chunk is None else None)
    if chunk is not None:
        previous.update(ledger.read_shard(job.out, ledger_id, marks))  # an interrupted run's part of this chunk
    inflight = InFlight(marks, keys)
    inflight.say(shard.id, previous)
    rows: dict[str, LedgerRow] = dict(previous) if chunk is None else {}  # unvisited rows are kept (a chunk: merge)
    get_encoder = functools.cache(functools.partial(load_encoder, job))  # loaded on first use only, then held
    state = shard_state(job, run or RunState(shard.id))
    with (
        outdir.snapshot(job.out),  # a store's existence checks answered by a listing (a LIST a 1000 samples)
        ledger.open_journal(job.out, ledger_id) as journal,
        preempt.cleanup(functools.partial(_seal_from_journal, job, ledger_id, journal)),
        get_format(job.spec.format, job.spec.family).open_writer(job.out, job.spec, writer_id) as writer,
    ):
        state.mark = functools.partial(journal.mark, alone=True)  # a sample read when its turn comes: nothing ahead
        loop = _Loop(
            job, shard, chunk, writer, journal, get_encoder, state, previous, rows, result, keys, run_id, on_row,
            inflight,
        )  # fmt: skip
        loop.spool = listing
        loop.background = isinstance(outdir.root(job.out), StoreOut) and isinstance(writer, PerSampleWriter)
        loop.commits = Commits(
            writer if loop.background else None,
            functools.partial(_commit, loop),  # type: ignore[arg-type]
        )
        crash = _loop_shard(loop)
    ledger.seal(job.out, ledger_id, rows.values())
    fault_point("shard")
    record.tally(result, rows.values())
    _work(result, state)
    result.store_retries = retries.take()  # this process's since the last take: each retry counted once
    result.seconds = round(time.perf_counter() - start, 3)
    if crash is not None:
        raise crash
    return result


def _loop_shard(loop: _Loop) -> BaseException | None:
    """Run the loop over the task's clips (read ahead where `read_ahead` says), then give each planned sample it
    did not visit its row; returns the error the loop crashed with (None: it ended, or was stopped). A whole-OUT
    write error stops it at once: what is done is sealed, and the error says what to do."""
    job, shard, chunk = loop.job, loop.shard, loop.chunk
    first, stop = (0, shard.quota) if chunk is None else (chunk.start, chunk.stop)
    wanted = functools.partial(_wanted, loop)
    source = open_source(job.source, job.spec, job.limits)
    whole = chunk is None and loop.keys is None and not job.run.text_offload
    kept = kept_listing(job, shard, loop.previous, loop.spool, whole)
    # the task's one listing of its shard (none where every sample is kept, or the plan recorded a store's tar)
    samples = (ref for ref in kept) if kept is not None else shard_samples(shard, source, loop.spool)
    clips: Iterator[SampleRef] = itertools.islice(samples, first, stop)
    if job.run.text_offload:  # the prompts first; then the text encoder is parked
        texts, encoder = loop.state.texts, loop.get_encoder
        held = phases.text_first_held(job, clips, _planned(shard, first, stop), wanted, encoder, texts)
        if held is None:  # not as planned: listed again, the prompts in a pass of their own
            samples.close()
            phases.text_first_of(job, source.samples(shard.shard), (first, stop), wanted, encoder, texts)
            samples = source.samples(shard.shard)
            held = itertools.islice(samples, first, stop)
        clips = held
    ahead = loop.state.ahead = read_ahead(job, clips, wanted, loop.journal)
    batches = loop.state.batches = ShapeBatches(ahead) if ahead is not None else None
    read_error: Exception | None = None
    crash: BaseException | None = None
    try:
        with (
            contextlib.closing(ahead) if ahead is not None else contextlib.nullcontext(),
            contextlib.closing(batches) if batches is not None else contextlib.nullcontext(),
            contextlib.closing(samples),
            contextlib.closing(loop.commits),  # the puts in flight waited for (after `_run`: none is left)
        ):
            _run(loop, ahead if ahead is not None else clips)
    except ShardReadError as exc:
        logger.error("shard %s: %s", shard.id, exc)
        loop.result.error, read_error = str(exc), exc
    except OutWriteError as exc:
        _seal_what_is_done(job, loop.ledger_id, loop.rows)
        raise type(exc)(stopping_message(job.out, exc), exc.path) from exc
    except UnsafePath:
        raise  # a link under OUT stops the run as it is (its journal is read again), not a crash of this shard
    except Exception as exc:  # a crash: its samples get rows, then it is raised again
        logger.error("shard %s crashed: %s", shard.id, exc, exc_info=not isinstance(exc, ShardBroken))
        crash = exc
    if loop.result.interrupted is None:
        seen = {**loop.previous, **loop.rows}
        for row in unvisited_rows(job, shard, chunk, seen, loop.keys, read_error=read_error, crash=crash):
            _journalled(loop, row)
    return crash


def _planned(shard: ShardPlan, first: int, stop: int | None) -> int:
    """How many clips of [first, stop) the plan listed in `shard`."""
    return max(min(shard.samples, stop if stop is not None else shard.samples) - first, 0)


def _wanted(loop: _Loop, ref: SampleRef) -> bool:
    """Whether the read-ahead takes `ref`: one the build encodes (`resume.wanted`) that is neither a suspect (tried
    alone when its turn comes) nor proven to kill its decoder."""
    previous = loop.previous.get(ref.key)
    if loop.inflight.suspect(ref.key, previous) or loop.inflight.killed(ref.key, previous):
        return False
    return resume.wanted(ref, loop.job, loop.previous, loop.keys)


def _run(loop: _Loop, clips: Iterator[SampleRef]) -> None:
    """Visit every clip (each of its windows), up to a stop asked for (SIGTERM, Ctrl-C): the shard ends there,
    after the sample in flight."""
    known_windows = ledger.windows_by_clip(loop.previous)
    commits = loop.commits
    assert commits is not None
    for clip in clips:
        if loop.keys is not None and not resume.selected(clip.key, loop.keys):
            continue
        windows = expand(clip, loop.job, known_windows.get(clip.key, []))
        for ref in windows:
            if loop.keys is not None and ref.key not in loop.keys and clip.key not in loop.keys:
                continue
            stopped = loop.state.run.stop()
            if stopped:
                loop.result.interrupted = stopped
                commits.drain()
                return
            count = len(windows) if ref.window is not None else None
            made, fresh = _visit(loop, ref, count)
            commits.add(made, (count, fresh))
    commits.drain()  # the shard's seal waits for its puts


def _commit(loop: _Loop, made: LedgerRow, note: tuple[int | None, bool]) -> None:
    """A visit's row, in the order of the visits: a new one journalled and counted (a sample's files put in the
    background: once they are in the store), then kept with the shard's rows and reported."""
    windows, fresh = note
    row = _new_row(loop, made, windows) if fresh else made
    loop.rows[row.key] = row
    if loop.on_row is not None:
        loop.on_row(row)


def _visit(loop: _Loop, ref: SampleRef, windows: int | None) -> tuple[LedgerRow | Pending, bool]:
    """One sample of the shard: its done row kept (checked against the source), or made now (a `Pending` while its
    files are put in the background); whether it is new (`_commit` journals it: a window's row records how many
    windows its clip has); a suspect is decoded alone in a child (`infra.preprocess.inflight`); a sample proven to
    kill its decoder is left failed, not encoded."""
    job = loop.job
    row, replace = loop.previous.get(ref.key), None
    if row is not None and resume.reusable(row, job):
        row, replace = resume.resumed(row, ref, job, f"{loop.shard_id}/{ref.key}", loop.result)
        if row is not loop.previous[ref.key]:
            loop.journal.append(row)
        if replace is None:
            return row, False
    elif loop.inflight.killed(ref.key, row) and row is not None:  # proven: not tried again unless --only names it
        return _left_failed(loop, row), False
    alone = loop.inflight.suspect(ref.key, row)
    made = process_sample(
        ref, job, loop.writer, loop.get_encoder, loop.state, replace_stale=replace, background=loop.background,
        alone=alone,
    )  # fmt: skip
    if isinstance(made, LedgerRow) and made.reason == KILLED_RUN:
        made.detail = blamed_detail(made.detail or "", loop.run_id)
    return made, True


def _new_row(loop: _Loop, row: LedgerRow, windows: int | None) -> LedgerRow:
    """A row made by this run: named, journalled, counted; the shard stops when its first encodes all failed."""
    _named(loop, row)
    if windows is not None:
        row.extra[WINDOWS_KEY] = windows
    loop.journal.append(row)
    loop.rows[row.key] = row  # here, not by the caller: a shard that stops below seals it too
    fault_point("sample")
    result = loop.result
    record.count_new(result, row)
    if result.encoded == 0 and result.encode_errors >= FAIL_FAST_AFTER:
        raise ShardBroken(f"the first {FAIL_FAST_AFTER} encodes of shard {result.shard} failed: {row.detail}")
    return row


def _left_failed(loop: _Loop, row: LedgerRow) -> LedgerRow:
    """An earlier run's proven killed_run row, kept: this run leaves it failed too (its `rerun --failed-only` takes
    it)."""
    if loop.run_id is None or row.extra.get("run_id") == loop.run_id:
        return row
    row = row.model_copy(deep=True)
    _named(loop, row)
    loop.journal.append(row)
    return row


def _named(loop: _Loop, row: LedgerRow) -> None:
    row.shard = loop.shard_id
    if loop.run_id:
        row.extra["run_id"] = loop.run_id


def _journalled(loop: _Loop, row: LedgerRow) -> None:
    """A row of a planned sample the task did not visit: journalled and kept with the shard's rows."""
    _named(loop, row)
    loop.journal.append(row)
    loop.rows[row.key] = row
    if loop.on_row is not None:
        loop.on_row(row)


def process_sample(
    ref: SampleRef,
    job: Job,
    writer: Writer,
    get_encoder: Callable[[], LoadedFamily],
    state: ShardState,
    *,
    replace_stale: str | None = None,
    background: bool = False,
    alone: bool = False,
) -> LedgerRow | Pending:
    """One sample's trip → its ledger row (done / skipped with a reason / failed with the error). Inputs are read
    and prepared before the model is asked for, so a run of bad inputs never loads one. `replace_stale` (the old
    file's sha256) re-encodes a sample whose source changed and replaces its files: approved at the stale gate.
    With `background` (a per-sample writer below an OUT in an object store), a sample with nothing at its paths is
    encoded and rendered here and returned `Pending`: its files are put in the background (`infra.preprocess.puts`),
    its row made when they are in the store. `alone` (a suspect): decoded in a child process (`infra.preprocess.alone`):
    a sample every such child died on is failed ``killed_run``, the deaths its proof."""
    start = time.perf_counter()
    disk = resume.on_disk(job, ref, replacing=replace_stale is not None)
    if disk.adopted is not None:  # written by an interrupted run of this spec: kept, not encoded now
        return record.row(ref, job, record.Outcome("done", written=disk.adopted, facts=disk.facts))
    if disk.foreign is not None and not disk.overwrite:
        return record.row(ref, job, record.Outcome(reason="output_exists", detail=disk.foreign, path=disk.files[0]))
    replace = replace_stale is not None or disk.overwrite
    outcome = record.Outcome()
    try:
        with stage_timing("prepare"):  # opt-in (bench/gpu/shot.py): which stage holds the encoder back
            prepared = _prepared(ref, job, state, alone)
        fault_point("decode")
        outcome.encoded = encode(prepared, job, get_encoder(), state)
        overwrite = replace or job.replace_from is not None
        if background and not disk.files and isinstance(writer, PerSampleWriter):
            with stage_timing("write"):  # rendered here; put on the pool while the next sample encodes
                rendered = writer.render(outcome.encoded.sample)
            outcome.seconds = round(time.perf_counter() - start, 4)
            return Pending(rendered, overwrite, functools.partial(put_ended, ref, job, outcome))
        with stage_timing("write"):
            outcome.written = write.write(job, writer, outcome.encoded.sample, disk.files, overwrite)
        outcome.status = "done"
        if replace_stale is not None:
            outcome.extra["replaced_stale"] = replace_stale
        elif replace or (disk.files and job.replace_from is not None and not outcome.written.adopted):
            outcome.extra["replaced"] = job.replace_from
    except InputError as exc:
        outcome = record.Outcome("skipped", exc.reason, exc.detail)
    except (ModelLoadError, OutWriteError, UnsafePath):
        raise  # fails the shard (and so the run), not each sample: a link under OUT is damage of OUT, not a sample
    except FileExistsError as exc:
        outcome = record.Outcome(reason="output_exists", detail=str(exc))
    except ChildKilled as exc:
        logger.error("sample %s: %s", ref.key, exc)
        outcome = record.Outcome(reason=KILLED_RUN, detail=str(exc), extra={PROOF: exc.evidence()})
    except Exception as exc:
        logger.exception("sample %s failed", ref.key)
        outcome = record.Outcome(reason="encode_error", detail=f"{type(exc).__name__}: {exc}")
    outcome.seconds = round(time.perf_counter() - start, 4)
    return record.row(ref, job, outcome)


def _prepared(ref: SampleRef, job: Job, state: ShardState, alone: bool) -> PreparedSample:
    """The sample read and prepared: by the read-ahead (either or both), else now (its start marked first); `alone`:
    prepared in a child process (`infra.preprocess.alone`)."""
    taken = state.ahead.take(ref) if state.ahead is not None else None
    if isinstance(taken, PreparedSample):
        return taken
    if taken is None and state.mark is not None:
        state.mark(ref.key)
    raw = taken if taken is not None else read(ref, CaptionRules.of(job.spec))
    if not alone:
        return prepare(raw, job)
    ahead = state.ahead is not None and state.ahead.depth > 0  # where nothing died, the read-ahead's decoders had it
    return prepare_alone(raw, job, decoding_team(job, ahead))


def _seal_from_journal(job: Job, shard_id: str, journal: ledger.Journal | ledger.StoreJournal) -> None:
    """Seal the shard from what its ledger and journal hold now (the process is ending at once; a store's journal
    puts what it keeps first)."""
    journal.flush()
    ledger.seal(job.out, shard_id, ledger.read_shard(job.out, shard_id).values())


def _seal_what_is_done(job: Job, shard_id: str, rows: dict[str, LedgerRow]) -> None:
    """Seal on a full or read-only OUT when the ledger can still be written; otherwise the journal stays (a rerun
    reads it)."""
    try:
        ledger.seal(job.out, shard_id, rows.values())
    except OutWriteError:
        logger.warning("shard %s: no room to seal its ledger; its journal is kept for the next run", shard_id)


def _work(result: ShardResult, state: ShardState) -> None:
    """What the encoders did for the shard: text-encoder calls and prompts encoded, VAE calls and clips."""
    text, vae = state.texts.stats, state.vae
    result.text_calls, result.prompts_encoded = text.calls, text.encoded
    result.vae_calls, result.vae_clips = vae.calls, vae.clips
