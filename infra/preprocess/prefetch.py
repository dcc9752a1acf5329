"""Run ahead of the encoder inside a shard: the next samples are read, decoded, sampled and resized while the
current one is encoded (``--prefetch N`` samples ahead, on ``--decode-workers`` threads or, with ``--decode-pool
process``, processes: `infra.preprocess.decoders`).

The shard loop iterates a `Prefetcher` instead of the source's samples; it yields the same refs in the same order.
The shard's state (`infra.preprocess.state.ShardState`) carries it to the stages that batch with what it has read
or prepared ahead (`upcoming`: `infra.preprocess.texts`; `prepared_ahead`: `infra.preprocess.shape_batches`).
Reading a sample's bytes (prompt, video) happens on the loop's own thread, as the source's readers expect (a tar is
one file position); only decoding and resizing run on the decoders. The shard loop takes what was prepared for its ref
(`take`), or reads and prepares it itself when nothing was (a sample kept from the ledger is never read ahead). What
a sample raises while prepared ahead (an InputError, a decode error) is raised when its turn comes, so its ledger
row is the one it gets without prefetching; a source that fails mid-shard (ShardReadError) fails at the same point.
A stop (SIGTERM, Ctrl-C) between samples drops what was prepared ahead: the pool's queued work is cancelled.

A source in an object store (a URL) is read ahead by a reader thread instead (`threaded`): the source's listing (a
tar's headers, on its first sample) and the next samples' bytes are fetched while the loop encodes, one sample past
what the loop asks for (so the loop finds it there); the same rules hold (the source is touched by one thread at a
time: the reader stops after a sample it does not read ahead until the loop has visited it), and the loop still
waits for the same samples to be read as without the thread, so text batching sees the same prompts. Memory: the
bytes of at most ``2 + lookahead`` samples are held.

Each decoder still runs one FFmpeg thread (`infra.media.video._open`: frame threading can drop a damaged last
packet's error); the parallelism is across samples.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from infra.cache import ledger
from infra.job import Job
from infra.media.prompts import CaptionRules
from infra.media.temporal import TemporalPolicy
from infra.outstore import is_url
from infra.preprocess.decoders import Decoders, decoders
from infra.preprocess.prepare import PreparedSample
from infra.preprocess.read import RawSample, read
from infra.sources import SampleRef

logger = logging.getLogger(__name__)

Reader = Callable[[SampleRef], RawSample]


@dataclass
class _Entry:
    ref: SampleRef
    raw: RawSample | None = None
    error: BaseException | None = None
    future: Future[PreparedSample] | None = None


class _End:
    """The source's own end or failure, kept in the queue at the point where it came."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class Prefetcher:
    """The refs of `refs`, in order; those `wanted` are read `lookahead` ahead (their prompts known for text
    batching) and the first `depth` of them decoded ahead on `decoders` (shut down by `close`; None when `depth`
    is 0). `threaded`: pulled and read by a reader thread, one sample further ahead (see the module)."""

    def __init__(
        self,
        refs: Iterator[SampleRef],
        *,
        read: Reader,
        decoders: Decoders | None,
        wanted: Callable[[SampleRef], bool],
        depth: int,
        lookahead: int,
        threaded: bool = False,
    ) -> None:
        self._refs, self._read, self._wanted = refs, read, wanted
        self.depth, self.lookahead = depth, max(depth, lookahead)
        self._pool = decoders if depth else None
        self._queue: deque[_Entry | _End] = deque()
        self._current: _Entry | None = None
        self._done = False
        self._cond = threading.Condition()  # guards the queue when a reader thread fills it
        self._paused: _Entry | None = None  # the reader waits until the loop has visited this one (not read ahead)
        self._reader: threading.Thread | None = None
        if threaded:
            self._reader = threading.Thread(target=self._read_on, name="lf-read-ahead", daemon=True)
            self._reader.start()

    def __iter__(self) -> Iterator[SampleRef]:
        return self

    def __next__(self) -> SampleRef:
        self._fill(1 + self.lookahead)
        with self._cond:
            head = self._queue.popleft()
            self._cond.notify_all()  # a reader thread has room again
        if isinstance(head, _End):
            self._done = True
            self._queue.clear()
            if head.error is not None:
                raise head.error
            raise StopIteration
        self._current = head
        if _read_ahead(head):  # its bytes are in memory: the source may move on (and close at its end)
            self._fill(1 + self.lookahead)  # the next ones start decoding while this one is encoded
        return head.ref

    def _fill(self, size: int) -> None:
        """Pull refs up to `size` queued, stopping after one that is not read ahead (a sample kept from the ledger
        may still read its source while it is visited: the source must not have moved past it, or ended). With a
        reader thread: wait until it has queued as many."""
        if self._reader is not None:
            self._wait_filled(size)
            return
        while not self._done and len(self._queue) < size:
            if self._queue and not _read_ahead(self._queue[-1]):
                break
            entry = self._pull()
            self._queue.append(entry)
            if isinstance(entry, _End):
                break
        self._submit()

    def _pull(self) -> _Entry | _End:
        """The next ref, read when it is wanted; the source's end or failure as an `_End`."""
        try:
            ref = next(self._refs)
        except StopIteration:
            return _End(None)
        except Exception as exc:  # noqa: BLE001 - raised again when the loop reaches this point
            return _End(exc)
        entry = _Entry(ref)
        if self._wanted(ref):
            try:
                entry.raw = self._read(ref)
            except Exception as exc:  # noqa: BLE001 - the sample's own error, raised at its turn
                entry.error = exc
        return entry

    def _wait_filled(self, size: int) -> None:
        """The loop's side of `_fill` with a reader thread: the visit of the sample the reader stopped after is over
        (the loop is here again), so it goes on; then wait for `size` queued, or the reader's stop or end."""
        with self._cond:
            if self._paused is not None and self._paused is self._current:
                self._paused = None
                self._cond.notify_all()
            self._cond.wait_for(lambda: len(self._queue) >= size or (bool(self._queue) and _stops(self._queue[-1])))
        self._submit()

    def _read_on(self) -> None:
        """The reader thread: keep one sample more queued than the loop waits for; stop after one not read ahead
        until the loop has visited it; end at the source's end or failure, or when closed."""
        room = 2 + self.lookahead
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._done or (self._paused is None and len(self._queue) < room))
                if self._done:
                    return
            try:
                entry = self._pull()
            except Exception as exc:  # noqa: BLE001 - `wanted` failed (OUT unreadable): raised at this point
                entry = _End(exc)
            with self._cond:
                if self._done:
                    return
                self._queue.append(entry)
                if isinstance(entry, _Entry) and not _read_ahead(entry):
                    self._paused = entry
                self._cond.notify_all()
            if isinstance(entry, _End):
                return

    def _submit(self) -> None:
        if self._pool is None:
            return
        for entry in self._entries()[: self.depth]:
            if isinstance(entry, _Entry) and entry.raw is not None and entry.future is None:
                entry.future = self._pool.submit(entry.raw)

    def take(self, ref: SampleRef) -> PreparedSample | RawSample | None:
        """What was made ahead of the ref being visited: prepared, or only read (not decoded ahead); None when it
        was not read ahead. Raises what reading or preparing it raised."""
        entry = self._current
        if entry is None or entry.ref is not ref or (entry.raw is None and entry.error is None):
            return None
        self._current = None
        if entry.error is not None:
            raise entry.error
        return entry.future.result() if entry.future is not None else entry.raw

    def prepared_ahead(self) -> Iterator[PreparedSample]:
        """The samples prepared ahead, in order, each as its decode finishes (waited for as it is asked for): what
        `infra.preprocess.shape_batches` batches by shape. A sample whose reading or decoding failed is left out (its
        error comes at its turn, from `take`)."""
        for entry in self._entries():
            if not isinstance(entry, _Entry):
                return
            if entry.future is None or entry.error is not None:
                continue
            try:
                prepared = entry.future.result()
            except Exception:  # noqa: BLE001 - raised again by `take` at its turn
                continue
            yield prepared

    def upcoming(self) -> list[str]:
        """The prompts of the samples read ahead, in order (text batching encodes them with the current one)."""
        ahead = self._entries()[: 1 + self.lookahead]  # as many as the loop waited for (a reader's extra one: not yet)
        return [e.raw.prompt for e in ahead if isinstance(e, _Entry) and e.raw is not None]

    def _entries(self) -> list[_Entry | _End]:
        with self._cond:
            return list(self._queue)

    def close(self) -> None:
        """Drop what was prepared ahead: queued decodes are cancelled, running ones finish (one sample each)."""
        with self._cond:
            self._done = True
            self._cond.notify_all()
        if self._reader is not None:
            self._reader.join()  # after its pull in flight (one request at most): the source is ours to close
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown()
        close = getattr(self._refs, "close", None)
        if close is not None:
            close()


def _stops(entry: _Entry | _End) -> bool:
    """Whether nothing is pulled after `entry` until the loop has visited it (not read ahead; or the end)."""
    return not _read_ahead(entry)


def _read_ahead(entry: _Entry | _End) -> bool:
    """Whether the entry's bytes were read (or its reading failed): nothing more will be read from the source for it."""
    return isinstance(entry, _Entry) and (entry.raw is not None or entry.error is not None)


def read_ahead(
    job: Job, refs: Iterator[SampleRef], wanted: Callable[[SampleRef], bool], journal: ledger.Journal
) -> Prefetcher | None:
    """The shard's read-ahead over the samples it will encode, each marked in `journal` before it is read; None
    without one (``--prefetch 0 --text-batch 1``, or ``windows:K``, whose samples are made from their clip as it is
    visited)."""
    run = job.run
    serial = run.prefetch == 0 and run.text_batch == 1 and job.gather == 1
    if serial or TemporalPolicy.of(job.spec).kind == "windows":
        return None
    depth = max(run.prefetch, job.gather - 1)  # a batch is made of samples already prepared
    pool = decoders(run.decode_pool, run.decode_workers, job) if depth else None
    return Prefetcher(
        refs,
        read=functools.partial(_marked_read, journal, CaptionRules.of(job.spec)),
        decoders=pool,
        wanted=wanted,
        depth=depth,
        lookahead=run.text_batch - 1,
        threaded=is_url(job.source.partition(":")[2]),  # a store's reads wait on the network: off the loop's thread
    )


def _marked_read(journal: ledger.Journal, captions: CaptionRules, ref: SampleRef) -> RawSample:
    """Read ahead, its start marked first (`infra.preprocess.inflight`): others may be in flight with it."""
    journal.mark(ref.key, alone=False)
    return read(ref, captions)
