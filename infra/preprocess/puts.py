"""Background puts: an OUT in an object store gets a sample's files on a small pool of threads while the shard's
thread encodes the next sample (a local OUT writes on the shard's thread, as before: its writes are a rename each).

The shard's thread renders a sample's files (their bytes) and hands them to `Commits` as a `Pending`; the PUTs run on
`PUT_WORKERS` threads. Every visit's result passes through `Commits` in the order the shard visited its samples, and a
row is committed (journalled, counted, reported) only when every sample before it is committed and, for a `Pending`,
when each of its files is in the store: a crash never leaves a done row without its bytes (a file put without its
row is adopted by the next run: `infra.preprocess.resume`). What a put raises is the sample's row when its turn
comes (an object in the way: ``output_exists``; another error: ``encode_error``), or stops the shard there (a store
that refuses writes, a lost lease: `infra.errors.OutWriteError`, one line for the run).

Memory: at most `MAX_BYTES` of rendered files wait or are in flight (a sample larger than that alone), and at most
`MAX_SAMPLES` samples: the shard's thread waits for the oldest put before it hands over one more.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from infra.cache.ledger import LedgerRow
from infra.errors import OutWriteError
from infra.formats import PerSampleWriter, WrittenSample
from infra.job import Job
from infra.outdir import UnsafePath
from infra.preprocess.record_row import Outcome, row
from infra.preprocess.write import WrittenFiles
from infra.sources import SampleRef

logger = logging.getLogger(__name__)

#: The rendered bytes that may wait for their puts or be in flight at once, per shard task.
MAX_BYTES = 64 * 1024 * 1024
#: The samples whose rows may wait for their puts at once, per shard task.
MAX_SAMPLES = 8
#: The threads that PUT, per shard task. One: the puts overlap the encoder, not each other, so a store that refuses
#: writes sees one refused request (the puts queued after it are not sent: `Commits._put`), as without the pool.
PUT_WORKERS = 1

Rendered = list[tuple[list[str], str, bytes]]


@dataclass
class Pending:
    """A sample encoded and rendered whose files are not yet in the store: `finish` makes its row from what its put
    ended with (the files written, or the error it raised)."""

    files: Rendered
    overwrite: bool
    finish: Callable[[WrittenSample | BaseException], LedgerRow]
    future: Future[WrittenSample] | None = None

    @property
    def size(self) -> int:
        return sum(len(data) for _, _, data in self.files)


class Commits:
    """The shard's visits committed in order (`commit` is handed each one's row, or what a visit returned that is
    not a `Pending`), each `Pending` once its files are put by `writer` on a pool of `workers` threads; at most
    `max_bytes` and `max_samples` waiting (see the module). `close` waits for the puts in flight and commits none."""

    def __init__(
        self,
        writer: PerSampleWriter | None,
        commit: Callable[[Any, Any], None],
        *,
        max_bytes: int = MAX_BYTES,
        max_samples: int = MAX_SAMPLES,
        workers: int = PUT_WORKERS,
    ) -> None:
        self._writer, self._commit = writer, commit
        self.max_bytes, self.max_samples = max_bytes, max_samples
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="lf-put") if writer is not None else None
        self._queue: deque[tuple[Any, Any]] = deque()  # (what the visit returned, the caller's note), in order
        self.waiting_bytes = 0
        self.peak_bytes = 0  # the most rendered bytes that waited at once (tests check the bound)
        self.peak_samples = 0
        self._stopped: OutWriteError | None = None  # a put the store refused, or a lost lease: no later put is sent

    def add(self, made: Any, note: Any = None) -> None:
        """A visit's result: committed now when nothing waits before it, else queued behind the puts before it (a
        `Pending`'s put starts once the bound has room: the oldest waited for first)."""
        self._commit_ready()
        if isinstance(made, Pending):
            assert self._pool is not None, "a Pending needs a writer to put its files"
            while self._queue and (
                self.waiting_bytes + made.size > self.max_bytes or self._pending() >= self.max_samples
            ):
                self._commit_head()
            made.future = self._pool.submit(self._put, made)
            self.waiting_bytes += made.size
            self.peak_bytes = max(self.peak_bytes, self.waiting_bytes)
        self._queue.append((made, note))
        self.peak_samples = max(self.peak_samples, self._pending())
        self._commit_ready()

    def drain(self) -> None:
        """Commit every visit still queued, waiting for their puts (the shard's end, or a stop between samples)."""
        while self._queue:
            self._commit_head()

    def close(self) -> None:
        """Wait for the puts in flight, start no other, commit nothing more (after `drain`: nothing is left)."""
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _put(self, pending: Pending) -> WrittenSample:
        assert self._writer is not None
        if self._stopped is not None:
            raise self._stopped
        try:
            return self._writer.write_rendered(pending.files, replace=pending.overwrite)
        except OutWriteError as exc:
            self._stopped = exc
            raise

    def _pending(self) -> int:
        return sum(isinstance(made, Pending) for made, _ in self._queue)

    def _commit_ready(self) -> None:
        while self._queue and _ready(self._queue[0][0]):
            self._commit_head()

    def _commit_head(self) -> None:
        made, note = self._queue.popleft()
        if isinstance(made, Pending):
            assert made.future is not None
            try:
                ended: WrittenSample | BaseException = made.future.result()
            except Exception as exc:  # noqa: BLE001 - the sample's `finish` says what it means (or raises it)
                ended = exc
            self.waiting_bytes -= made.size
            made.files = []  # the bytes are in the store (or refused): not held any longer
            made = made.finish(ended)
        self._commit(made, note)


def _ready(made: Any) -> bool:
    return not isinstance(made, Pending) or (made.future is not None and made.future.done())


def put_ended(ref: SampleRef, job: Job, outcome: Outcome, ended: WrittenSample | BaseException) -> LedgerRow:
    """The row of a sample whose files were put in the background, from what the put ended with: done, or the row
    its error gives (as `process_sample`'s); a store that refuses writes, or a lost lease, stops the shard."""
    if isinstance(ended, WrittenSample):
        outcome.written, outcome.status = WrittenFiles(ended.records(job.out)), "done"
        return row(ref, job, outcome)
    if isinstance(ended, OutWriteError | UnsafePath) or not isinstance(ended, Exception):
        raise ended
    seconds = outcome.seconds
    if isinstance(ended, FileExistsError):
        outcome = Outcome(reason="output_exists", detail=str(ended))
    else:
        logger.error("sample %s failed: %s", ref.key, ended, exc_info=ended)
        outcome = Outcome(reason="encode_error", detail=f"{type(ended).__name__}: {ended}")
    outcome.seconds = seconds
    return row(ref, job, outcome)
