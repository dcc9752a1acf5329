"""Opt-in timing of the encoder calls, for `bench/gpu_bench.py`: with ``LATENTFORGE_ENCODE_TIMING=FILE`` every sample's
encode (its video latents and prompt embedding, `infra.preprocess.encode.encode`) appends one JSON line to FILE:
``{"pid", "stage", "clock", "start", "end", "peak_bytes", "thread"}`` (the thread that made the call); the stage is
``encode``, or, inside it, ``text`` (the prompt's encoder call); `stage_timing` adds the host's ``prepare`` (the
shard loop waiting for its sample's pixels: read and decode, ahead or not) and ``write`` spans, so a bench can say
which stage holds the encoder back. Unset (always, outside the bench), `encode_timing` is one environment lookup and a
`nullcontext`: nothing is recorded, synchronised or allocated.

On CUDA, ``start`` and ``end`` are CUDA events recorded on the stream around the calls (``clock`` ``cuda-events``):
when the device reached them, placed on the wall clock (``time.time``, the clock of the sample files' mtimes) through
a reference event taken once per process while the device was idle; ``peak_bytes`` is the process's
``torch.cuda.max_memory_allocated`` so far. A thread of the hook's own waits for each span's end event and writes
its line, so a shard thread never waits on the hook. Elsewhere they are the wall-clock times of the call (``clock``
``host``) and ``peak_bytes`` is null. Two shard threads' calls may overlap in time (each waits for the family's
lock inside its span): a reader takes the union of the intervals, not their sum.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from infra.devices import resolve_device

ENV = "LATENTFORGE_ENCODE_TIMING"

_lock = threading.Lock()
_reference: tuple[torch.cuda.Event, float] | None = None  # (an event, the wall-clock time the device reached it)
_pending: queue.SimpleQueue = queue.SimpleQueue()  # (file, begin, end) of the CUDA spans not yet written


def encode_timing(device: str, stage: str = "encode") -> AbstractContextManager[None]:
    """A span around one sample's encoder calls on `device` (a ``--device`` value), recorded to
    ``$LATENTFORGE_ENCODE_TIMING`` when set."""
    path = os.environ.get(ENV)
    return _timed(Path(path), resolve_device(device), stage) if path else nullcontext()


def stage_timing(stage: str) -> AbstractContextManager[None]:
    """A host-clock span of the shard loop's `stage` (``prepare``, ``write``), recorded when the hook is on."""
    path = os.environ.get(ENV)
    return _timed(Path(path), torch.device("cpu"), stage) if path else nullcontext()


def read_timings(path: Path) -> list[dict]:
    """The spans a timing file holds (none when it is not there)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@contextmanager
def _timed(path: Path, device: torch.device, stage: str) -> Iterator[None]:
    if device.type != "cuda":
        start = time.time()
        yield
        span = {"stage": stage, "clock": "host", "start": start, "end": time.time(), "peak_bytes": None}
        _append(path, {**span, "thread": threading.current_thread().name})
        return
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _reference_and_writer()
    begin.record()
    yield
    end.record()
    thread = threading.current_thread().name
    _pending.put((path, stage, thread, begin, end))  # waited for by the writer thread: this one goes on to its write


def _reference_and_writer() -> tuple[torch.cuda.Event, float]:
    """This process's reference event and the wall-clock time at it, recorded on an idle device (so the time the
    host sees it done is the time the device reached it, to within a synchronisation's latency); and the thread
    that waits for each span's end event and writes its line (a shard thread waiting there would stall behind the
    other shard thread's encode, which the build itself does not)."""
    global _reference  # one reference per process, taken at its first timed call
    with _lock:
        if _reference is None:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            _reference = (event, time.time())
            threading.Thread(target=_write_cuda_spans, name="encode-timing", daemon=True).start()
        return _reference


def _write_cuda_spans() -> None:
    reference, at = _reference_and_writer()
    while True:
        path, stage, thread, begin, end = _pending.get()
        end.synchronize()
        span = {"start": at + reference.elapsed_time(begin) / 1000, "end": at + reference.elapsed_time(end) / 1000}
        peak = torch.cuda.max_memory_allocated()
        _append(path, {"stage": stage, "clock": "cuda-events", **span, "peak_bytes": peak, "thread": thread})


def _append(path: Path, span: dict) -> None:
    with _lock, path.open("a", encoding="utf-8") as fh:  # one short line per call: appends do not interleave
        fh.write(json.dumps({"pid": os.getpid(), **span}) + "\n")
