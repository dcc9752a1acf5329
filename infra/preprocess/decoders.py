"""Where the shard's read-ahead decodes (``--decode-pool``): `workers` threads of the shard task's process (the
default), or `workers` decoder processes started once for the shard task and kept for all its samples.

Threads share the GIL: PyAV releases it while FFmpeg decodes, but the Python-side frame work (picking, converting,
the resize calls) holds it, so threads stop scaling after a couple of cores (bench/README.md, "Decoders").
Each thread computes with its share of the intra-op threads torch gives a thread here (`decoder_team`), not a whole
team each.
Processes do not share the GIL. A process is started with the spawn context (no fork of a process that holds torch's and
Prefect's threads), its torch on one intra-op thread (the parallelism is across samples; the resize computes each
output value alone, so its bytes do not depend on the thread count), and it takes the spec and limits once, at
start. Each sample ships its media bytes there and its pixels back in shared memory: the pool's context is
`torch.multiprocessing`'s, whose reducers move a returned tensor's storage to a shared-memory file and pass its
descriptor, so the pixels are copied once, in the decoder, and mapped here (through a pipe, as pickled numpy bytes,
the 274 MB of a 33×832² clip cost this process 0.43 CPU-s a clip: more than the decode saved).

Both kinds hand back the same `PreparedSample` for the same bytes. A sample's error comes back as its own: an
`InputError` as itself (its reason and detail), anything else that cannot cross the pipe as a RuntimeError
naming it. A decoder process that dies (a crash in FFmpeg, the kernel's OOM killer) breaks its pool; the samples
that were in it are decoded once more in a fresh pool, and one that breaks that one too fails with the error. A
decoder ignores the signals that stop a run (SIGTERM, SIGINT, SIGHUP): stopping is the shard's to do.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Literal, Protocol

import torch
import torch.multiprocessing
from threadpoolctl import threadpool_limits

from infra.faults import fault_point
from infra.job import Job
from infra.preprocess.prepare import Decoded, PreparedSample, decode_media, prepare, prepared_sample
from infra.preprocess.read import RawSample

logger = logging.getLogger(__name__)

PoolKind = Literal["thread", "process"]
#: The fault point a decoder process reaches before each decode (``LATENTFORGE_KILL_FILE``: how a test kills one).
DECODER_POINT = "decoder"


class Decoders(Protocol):
    """The read-ahead's decoders: `submit` a sample's bytes, get its future `PreparedSample`."""

    def submit(self, raw: RawSample) -> Future[PreparedSample]: ...

    def shutdown(self) -> None:
        """Cancel the queued decodes; wait for the running ones (one sample each)."""


class ThreadDecoders:
    """`decode` on `workers` threads of this process, each computing with its share of torch's intra-op threads."""

    def __init__(self, decode: Callable[[RawSample], PreparedSample], workers: int) -> None:
        self._decode = decode
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="lf-decode", initializer=_start_decoder_thread, initargs=(workers,)
        )

    def submit(self, raw: RawSample) -> Future[PreparedSample]:
        return self._pool.submit(contextvars.copy_context().run, self._decode, raw)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class ProcessDecoders:
    """`decode_media` under `job` (what `prepare` decodes) in `workers` spawned processes, kept until `shutdown`; a
    pool broken by a dead process is replaced, and its samples decoded once more."""

    def __init__(self, job: Job, workers: int) -> None:
        self._job, self._workers = job, workers
        self._lock = threading.Lock()
        self._pool = self._start()
        self._closed = False

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self._workers,
            mp_context=torch.multiprocessing.get_context("spawn"),  # its reducers: a tensor crosses in shared memory
            initializer=_start_decoder,
            initargs=(self._job,),
        )

    def submit(self, raw: RawSample) -> Future[PreparedSample]:
        out: Future[PreparedSample] = Future()
        self._send(raw, out, tries=1)
        return out

    def _send(self, raw: RawSample, out: Future[PreparedSample], tries: int) -> None:
        with self._lock:
            pool = self._pool
        try:
            child = pool.submit(_decode_in_child, raw.media, raw.roles, raw.ref.window)
        except BrokenProcessPool as exc:  # broken before its samples landed: this one is sent to a fresh pool
            self._again(raw, out, tries, pool, exc)
            return
        except RuntimeError as exc:  # shut down by a stop: nothing more is decoded
            out.set_exception(exc)
            return
        child.add_done_callback(lambda done: self._landed(raw, out, tries, pool, done))

    def _landed(
        self, raw: RawSample, out: Future[PreparedSample], tries: int, pool: ProcessPoolExecutor, done: Future
    ) -> None:
        """The child's answer → the sample's future (called on the pool's own thread as the answer lands)."""
        if done.cancelled():
            out.cancel()
            return
        error = done.exception()
        if isinstance(error, BrokenProcessPool):
            self._again(raw, out, tries, pool, error)
        elif error is not None:
            out.set_exception(error)
        else:
            out.set_result(prepared_sample(raw, done.result()))

    def _again(
        self, raw: RawSample, out: Future[PreparedSample], tries: int, pool: ProcessPoolExecutor, error: Exception
    ) -> None:
        """A sample caught in a broken pool: decoded once more in a fresh one, or failed with `error`."""
        with self._lock:
            again = tries == 1 and not self._closed
            if again and self._pool is pool:  # the first of its samples back replaces it; the broken one ends itself
                self._pool = self._start()
        if not again:
            out.set_exception(error)
            return
        logger.warning("a decoder process died (%s): decoding %s again in a fresh pool", error, raw.ref.key)
        self._send(raw, out, tries + 1)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            pool = self._pool
        pool.shutdown(wait=True, cancel_futures=True)


def decoder_team(default: int, workers: int) -> int:
    """The intra-op threads one of `workers` decoder threads computes with: torch's `default` for a thread of this
    process, shared among them (a 16-core host's 8 decoders: 2 each; one decoder keeps them all)."""
    return max(1, default // workers)


def decoding_team(job: Job, decoders_ahead: bool) -> int:
    """The intra-op threads a sample of `job` is decoded with where nothing died, read on the shard's thread: a
    read-ahead decoder's when the shard decodes ahead (1 in a decoder process; a decoder thread's share, of what a new
    thread starts with: this thread's setting), else this thread's own (the loop prepares it). The resize's rounding
    depends on it at real sizes: a sample decoded elsewhere (a suspect's child) computes with as many."""
    own = torch.get_num_threads()
    if not decoders_ahead:
        return own
    return 1 if job.run.decode_pool == "process" else decoder_team(own, job.run.decode_workers)


def _start_decoder_thread(workers: int) -> None:
    """A decoder thread's OpenMP team: its share, not torch's whole default each. An OpenMP team's size is the
    calling thread's own setting, which torch gives a thread the first time it computes there (from the process's
    `torch.set_num_threads`, else the cores): 8 decoder threads on 16 cores would each start teams of 16 whose
    waiting threads spin on the cores the others decode on. Set here for this thread alone (threadpoolctl's
    `omp_set_num_threads`), after torch's first setting: `torch.set_num_threads` would also change what every new
    thread starts with, the encoder's included. The resize computes each output value alone: the same bytes on
    any team."""
    team = decoder_team(torch.get_num_threads(), workers)  # the first call in a thread gives it torch's setting
    threadpool_limits(limits=team, user_api="openmp")


def decoders(kind: PoolKind, workers: int, job: Job) -> Decoders:
    """The read-ahead's decoders of `kind`, preparing each sample under `job` (`prepare`): on threads of this
    process, or in decoder processes (the same code in another interpreter)."""
    if kind == "process":
        return ProcessDecoders(job, workers)
    return ThreadDecoders(functools.partial(prepare, job=job), workers)


# A decoder process's own state, set once by its initializer (the pool's way to hand every task the same
# arguments without sending them with each): the job every sample of the shard is decoded under.
_job: dict[str, Job] = {}


#: What stops a run (`infra.ops.preempt`): a decoder ignores them. A Ctrl-C reaches the terminal's whole process group
#: and a SIGTERM may (`timeout`, a container's stop); the shard stops between samples and shuts its decoders down
#: (a decoder killed by the signal would break the pool and fail the sample in flight). A decoder whose shard task
#: is gone (SIGKILL) ends on its pipe's end.
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _start_decoder(job: Job) -> None:
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)  # the parallelism is across samples: one decode, one core
    _job["job"] = job


def _decode_in_child(media: bytes, roles: dict[str, bytes], window: int | None) -> Decoded:
    fault_point(DECODER_POINT)
    try:
        return decode_media(media, roles, window, _job["job"])  # its tensors cross in shared memory
    except Exception as exc:  # noqa: BLE001 - the sample's own error, sent back as itself where it can cross
        raise crossable(exc) from None


def crossable(exc: Exception) -> Exception:
    """`exc` if it survives the pipe as itself, else a RuntimeError naming it (an unpicklable error would break
    the pool, failing every sample in it)."""
    try:
        back = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to cross is answered the same way
        back = None
    if type(back) is type(exc) and str(back) == str(exc):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}")
