"""The full preprocess: a task per shard (or per chunk of a large shard) on the configured runner.

At most ``config.run.workers`` tasks run at once, locally (threads) or on Ray (`infra.ops.runners`); progress counts
the samples of every task, wherever it runs. A task whose Ray worker (or node) was lost is resubmitted, as a new
task run, up to `LOST_WORKER_RESUBMITS` times: it resumes from its ledger, so nothing done is redone. When every
chunk of a shard has ended, its ledger parts are merged into the shard's ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run
from tqdm import tqdm

from infra import outdir
from infra.cache import ledger, listing
from infra.cache.ledger import LEDGER_DIR
from infra.cache.lock import lease_of
from infra.devices import DeviceSlots, placement, visible_accelerators
from infra.errors import OutWriteError
from infra.ops import preempt, runners
from infra.ops.progress import RunState
from infra.outdir import UnsafePath
from infra.plan import BuildPlan, ShardPlan, parse_only
from infra.preprocess.chunks import PARTS_DIR, Chunk, plan_chunks
from infra.preprocess.record_row import tally
from infra.preprocess.shard_result import ShardResult
from infra.storage import remove_stale_temps
from tasks.preprocess import merge_chunks, preprocess_shard

POLL_SECONDS = 2.0
#: How many times a task whose worker was lost (killed, OOM, node gone) is submitted again.
LOST_WORKER_RESUBMITS = 2


@dataclass
class _Unit:
    """One task's work: a shard, or one chunk of it."""

    shard: ShardPlan
    chunk: Chunk | None = None
    attempts: int = 0
    device: str | None = None  # where it runs (`infra.devices.placement`), while it runs


@dataclass
class _Shards:
    """The run's bookkeeping: chunks of each shard still out, their results, the shards' results."""

    chunks: dict[str, list[Chunk]] = field(default_factory=dict)
    open: dict[str, int] = field(default_factory=dict)
    partial: dict[str, list[ShardResult]] = field(default_factory=dict)
    results: list[ShardResult] = field(default_factory=list)


def run_shards(plan: BuildPlan) -> list[ShardResult]:
    """Submit the shards' tasks with at most config.run.workers running; report progress while they run. A stop
    (SIGTERM, Ctrl-C) or a full disk starts no new task; the running ones end (sealed), then the run stops."""
    run_key = str(flow_run.get_id() or id(plan))
    selection = parse_only(plan.config.selection.only)  # a rerun of what failed: only the named shards run
    chosen = [s for s in plan.shards if selection is None or s.id in selection]
    total = sum(s.samples if selection is None or selection[s.id] is None else len(selection[s.id]) for s in chosen)
    book, pending = _Shards(), []
    for shard in chosen:
        chunks = plan_chunks(shard, plan.config.run.chunk_size)
        book.chunks[shard.id], book.open[shard.id] = chunks or [], len(chunks or [None])
        pending += [_Unit(shard, chunk) for chunk in chunks] if chunks else [_Unit(shard)]
    full: list[OutWriteError | UnsafePath] = []  # what stops the run: a full or read-only OUT, a link under OUT
    run = RunState(run_key, lease=lease_of(plan.out))  # counts, stop check and lease, handed to every shard task
    slots, workers = _slots(plan)
    bar = tqdm(total=total, unit="sample", desc="encoding", disable=None)
    artifact = create_progress_artifact(0.0, key="build-progress", description=f"{plan.out}: {total} samples")
    try:
        with runners.shard_runner(plan.config, run_key) as submit:
            running: dict[PrefectFuture, _Unit] = {}
            while running or (pending and not full and not run.stop()):
                while pending and len(running) < workers and not full and not run.stop():
                    unit = pending.pop(0)
                    unit.attempts += 1
                    unit.device = slots.take() if slots is not None else None
                    params = {
                        "job": plan.job,
                        "shard": unit.shard,
                        "run": run,
                        "chunk": unit.chunk,
                        "device": unit.device,
                        "listing": shard_listing(plan, unit.shard.id),
                    }
                    running[submit(preprocess_shard, params)] = unit
                finished, _ = wait(list(running), timeout=POLL_SECONDS)
                for future in finished:
                    unit = running.pop(future)
                    if slots is not None and unit.device is not None:
                        slots.give(unit.device)
                    _finished(plan, book, unit, future, full, pending)
                counts = runners.snapshot(run)
                bar.update(min(counts.get("total", 0), total) - bar.n)
                bar.set_postfix(skipped=counts.get("skipped", 0), failed=counts.get("failed", 0))
                update_progress_artifact(artifact, min(100.0, 100.0 * counts.get("total", 0) / max(total, 1)))
    finally:
        bar.close()
        _merge_left(plan, book)  # chunks of a run stopped early: their parts sealed into the shard's ledger
    removed = remove_stale_temps(plan.out)  # no task runs now: a lost worker's partial files go
    if removed:
        get_run_logger().warning("removed %d partial files left by lost workers", removed)
    if full:
        raise full[0]
    preempt.check()
    return book.results


def shard_listing(plan: BuildPlan, shard_id: str) -> str | listing.Packed | None:
    """What a shard task is handed of the plan's listing: the spool's path on the local runner (the flow's own disk);
    on Ray the shard's part of it, carried with the task (`infra.cache.listing.packed`: a worker on another host
    cannot read a path of the driver's)."""
    if plan.spool is None or plan.config.run.runner != "ray":
        return plan.listing
    return listing.packed(plan.spool, shard_id)


def _slots(plan: BuildPlan) -> tuple[DeviceSlots | None, int]:
    """(where the local runner places each task, how many run at once): on ``--device cuda`` every visible GPU, or
    ``--devices``, a task at least on each (``--workers`` more share them); None where one device takes every task.
    On Ray, Ray places each task on a GPU of its own (``num_gpus=1``)."""
    run = plan.config.run
    if run.runner != "local" or run.device != "cuda":
        return None, run.workers
    devices = placement(run.device, run.devices, visible_accelerators("cuda"))
    if devices == ["cuda"]:
        return None, run.workers
    return DeviceSlots(devices), max(run.workers, len(devices))


def _finished(
    plan: BuildPlan,
    book: _Shards,
    unit: _Unit,
    future: PrefectFuture,
    full: list[OutWriteError | UnsafePath],
    pending: list[_Unit],
) -> None:
    """A task ended: its result kept (a chunk's until its shard's last chunk ends, then merged), or the task
    submitted again when its worker was lost."""
    logger = get_run_logger()
    name = unit.shard.id if unit.chunk is None else f"{unit.shard.id} chunk {unit.chunk.index}"
    try:
        result = future.result()
    except OutWriteError as exc:
        full.append(exc)
        if unit.chunk is None:
            return
        result = ShardResult(shard=unit.shard.id, error=str(exc))
    except UnsafePath as exc:  # a link under OUT is damage of OUT, not a loss to accept: the run stops with it
        full.append(exc)
        result = ShardResult(shard=unit.shard.id, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a crashed shard is reported; the other shards go on
        if runners.worker_lost(exc) and unit.attempts <= LOST_WORKER_RESUBMITS:
            logger.warning("%s: its worker was lost (%s); submitted again", name, type(exc).__name__)
            runners.mark_lost(future.task_run_id, exc)
            pending.insert(0, unit)
            return
        logger.error("shard %s crashed after its retries: %s", name, exc)
        result = _crashed(plan, unit, exc)
    if unit.chunk is None:
        book.results.append(result)
        return
    book.partial.setdefault(unit.shard.id, []).append(result)
    book.open[unit.shard.id] -= 1
    if book.open[unit.shard.id] == 0:
        _merge(plan, book, unit.shard)


def _crashed(plan: BuildPlan, unit: _Unit, exc: BaseException) -> ShardResult:
    """A crashed task's result: its counts from its ledger (what it sealed: its rows, and a failed row for each
    planned sample it did not reach), so the summary says what the ledger says."""
    result = ShardResult(shard=unit.shard.id, error=f"crashed: {type(exc).__name__}: {exc}")
    ledger_id = unit.shard.id if unit.chunk is None else unit.chunk.ledger_id(unit.shard.id)
    tally(result, ledger.read_shard(plan.out, ledger_id).values())
    return result


def _merge(plan: BuildPlan, book: _Shards, shard: ShardPlan) -> None:
    results = book.partial.pop(shard.id, [])
    book.results.append(merge_chunks(plan, shard, book.chunks[shard.id], results))


def _merge_left(plan: BuildPlan, book: _Shards) -> None:
    """Merge the shards whose chunks did not all run (a stop, a full disk): what their parts hold is kept."""
    parts = [e.name for e in outdir.entries(plan.out, f"{LEDGER_DIR}/{PARTS_DIR}")]
    for shard in plan.shards:
        chunked = bool(book.chunks.get(shard.id))
        if chunked and (shard.id in book.partial or any(n.startswith(f"{shard.id}.chunk-") for n in parts)):
            try:
                _merge(plan, book, shard)
            except OutWriteError as exc:
                get_run_logger().warning("shard %s: its chunks cannot be merged (%s); parts kept", shard.id, exc)
