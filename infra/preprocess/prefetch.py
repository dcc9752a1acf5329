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

Each decoder still runs one FFmpeg thread (`infra.media.video._open`: frame threading can drop a damaged last
packet's error); the parallelism is across samples.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from infra.cache import ledger
from infra.job import Job
from infra.media.prompts import CaptionRules
from infra.media.temporal import TemporalPolicy
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
    is 0)."""

    def __init__(
        self,
        refs: Iterator[SampleRef],
        *,
        read: Reader,
        decoders: Decoders | None,
        wanted: Callable[[SampleRef], bool],
        depth: int,
        lookahead: int,
    ) -> None:
        self._refs, self._read, self._wanted = refs, read, wanted
        self.depth, self.lookahead = depth, max(depth, lookahead)
        self._pool = decoders if depth else None
        self._queue: deque[_Entry | _End] = deque()
        self._current: _Entry | None = None
        self._done = False

    def __iter__(self) -> Iterator[SampleRef]:
        return self

    def __next__(self) -> SampleRef:
        self._fill(1 + self.lookahead)
        head = self._queue.popleft()
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
        may still read its source while it is visited: the source must not have moved past it, or ended)."""
        while not self._done and len(self._queue) < size:
            if self._queue and not _read_ahead(self._queue[-1]):
                break
            try:
                ref = next(self._refs)
            except StopIteration:
                self._queue.append(_End(None))
                break
            except Exception as exc:  # noqa: BLE001 - raised again when the loop reaches this point
                self._queue.append(_End(exc))
                break
            entry = _Entry(ref)
            if self._wanted(ref):
                try:
                    entry.raw = self._read(ref)
                except Exception as exc:  # noqa: BLE001 - the sample's own error, raised at its turn
                    entry.error = exc
            self._queue.append(entry)
        self._submit()

    def _submit(self) -> None:
        if self._pool is None:
            return
        for entry in list(self._queue)[: self.depth]:
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
        for entry in list(self._queue):
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
        return [e.raw.prompt for e in self._queue if isinstance(e, _Entry) and e.raw is not None]

    def close(self) -> None:
        """Drop what was prepared ahead: queued decodes are cancelled, running ones finish (one sample each)."""
        self._done = True
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown()
        close = getattr(self._refs, "close", None)
        if close is not None:
            close()


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
    )


def _marked_read(journal: ledger.Journal, captions: CaptionRules, ref: SampleRef) -> RawSample:
    """Read ahead, its start marked first (`infra.preprocess.inflight`): others may be in flight with it."""
    journal.mark(ref.key, alone=False)
    return read(ref, captions)
