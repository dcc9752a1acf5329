"""A suspect decoded and prepared alone, in a child process (`infra.preprocess.inflight`): what can take a process
down on a sample's bytes (a decoder's segfault, a decompression bomb's out-of-memory kill) takes the child down, and
the run goes on with the proof.

The sample's bytes are read here, as for any sample (reads are bounded: the cap is checked before the bytes arrive).
The child decodes and prepares them with the code every decoder runs (`infra.preprocess.prepare.decode_media`, under
the same limits) on as many intra-op threads as the calling thread computes with: the same bytes as `prepare` on that
thread (the resize's rounding depends on how its rows are split among threads: at 33x256², 1 and 2 threads differ by
6e-8), and sends back what it made, pickled whole (no shared memory that a dead parent could leave behind), or the
sample's own error (an `InputError` as itself). This process makes the `PreparedSample` of it, as with a decoder
process's answer.

A child that ends without an answer (killed by a signal, or an exit) is started once more, fresh: a death on the
sample, twice in a row with nothing else in the child, is the proof (`ChildKilled`, each death's process and signal).
A death counts only once the child has said it is ready (started, its job and the sample's bytes taken, about to
decode): a child that cannot start (an import that fails, the OOM killer picking it while it imports) says nothing
of the sample, and fails it as an ``encode_error`` (retried by the same command), never as ``killed_run``. Both
deaths happen in one run: a run that dies between them leaves its mark, and the next run starts the count again.
The child is started with the spawn context (no fork of a process that holds torch's and Prefect's threads), ignores
the signals that stop a run (stopping is the shard's, between samples), is killed when the thread that started it
ends (Linux's parent-death signal: a run killed from outside leaves no child decoding on), and offers itself first to
the kernel's out-of-memory killer (``oom_score_adj`` 1000: a sample that eats the host's memory ends its child, not
the run). There is no time bound beyond the decoders' own (a clip over ``--max-pixels`` / ``--max-frames`` is refused
before it is decoded), as for any decoder.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from infra.faults import fault_point
from infra.job import Job
from infra.media.prompts import CaptionRules
from infra.preprocess.decoders import STOPS, crossable
from infra.preprocess.prepare import Decoded, PreparedSample, decode_media, prepared_sample
from infra.preprocess.read import RawSample, read
from infra.procs import die_with_parent
from infra.sources import SampleRef

logger = logging.getLogger(__name__)

#: Children that die on a sample, one after another in one run, before it is recorded failed.
TRIES = 2
#: The fault point a child reaches before it decodes, with the sample's key (``LATENTFORGE_KILL_ON``: a test's
#: sample that kills every child decoding it).
SUSPECT_POINT = "suspect"
#: The fault point a child reaches before it says it is ready (a test's child that dies before it could decode).
STARTING_POINT = "suspect_start"
#: ``oom_score_adj``'s highest value: the first process the kernel's out-of-memory killer picks.
OOM_FIRST = 1000


@dataclass(frozen=True)
class Death:
    """A child that ended without an answer: its process id and exit code (negative: the signal that killed it)."""

    pid: int | None
    exitcode: int | None
    started: bool = True  # it had said it was ready: the sample's decode was under way

    def cause(self) -> str:
        """``SIGSEGV``, ``SIGKILL`` ..., or how it exited."""
        code = self.exitcode
        if code is not None and code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit {code} without an answer"

    def text(self) -> str:
        return f"process {self.pid}: {self.cause()}" + ("" if self.started else " before it was ready")


class ChildKilled(RuntimeError):
    """Every child that decoded the sample alone died on it (`TRIES` in a row): the proof it is recorded failed by."""

    def __init__(self, key: str, deaths: list[Death]) -> None:
        self.key, self.deaths = key, deaths
        super().__init__(
            f"the {len(deaths)} processes that decoded it alone, one after another, died on it "
            f"({'; '.join(d.text() for d in deaths)}): a decoder crash or an out-of-memory kill on its bytes"
        )

    @property
    def signal(self) -> str:
        """What ended the last child (``SIGSEGV``, ``SIGKILL`` ...)."""
        return self.deaths[-1].cause()

    def evidence(self) -> dict[str, Any]:
        """What its ledger row keeps as the proof: the last child's signal and every death."""
        return {"signal": self.signal, "deaths": [{"pid": d.pid, "exitcode": d.exitcode} for d in self.deaths]}


def prepare_alone(raw: RawSample, job: Job) -> PreparedSample:
    """`prepare(raw, job)`, its decode in a child process (started again once if it dies); raises what preparing
    raises (an InputError for bad input), `ChildKilled` when every child died on it, or a RuntimeError when a child
    died before it was ready (no proof)."""
    deaths: list[Death] = []
    for _ in range(TRIES):
        answer = _in_child(raw, job)
        if isinstance(answer, Death):
            deaths.append(answer)
            logger.warning("sample %s: the process decoding it alone died (%s)", raw.ref.key, answer.text())
            continue
        ok, made = answer
        if not ok:
            raise made
        return prepared_sample(raw, made)
    if all(death.started for death in deaths):
        raise ChildKilled(raw.ref.key, deaths)
    raise RuntimeError(f"the processes to decode it alone ended, not on it: {'; '.join(d.text() for d in deaths)}")


def tried_alone(ref: SampleRef, job: Job) -> ChildKilled | None:
    """`ref` read and prepared, its decode in a child (`prepare_alone`, what it made dropped): the proof when every
    child died on it, else None. Raises the sample's own error (an InputError for bad input)."""
    try:
        prepare_alone(read(ref, CaptionRules.of(job.spec)), job)
    except ChildKilled as exc:
        logger.warning("sample %s: %s", ref.key, exc)
        return exc
    return None


def _in_child(raw: RawSample, job: Job) -> tuple[bool, Any] | Death:
    """One child's answer: (True, `Decoded`), (False, the sample's error), or its `Death`."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    threads = torch.get_num_threads()  # this thread's intra-op team: the child computes with as many
    args = (theirs, job, threads, raw.ref.key, raw.media, raw.roles, raw.ref.window)
    child = context.Process(target=_child, args=args, name="lf-suspect", daemon=True)
    child.start()
    theirs.close()  # the child's end is the child's alone: its death ends the pipe
    try:
        ready = _received(ours)  # empty: started, about to decode
        data = _received(ours) if ready is not None else None
    finally:
        ours.close()
    child.join()
    if data is None:
        return Death(child.pid, child.exitcode, started=ready is not None)
    return pickle.loads(data)  # this process's own child's answer, through its own pipe (no file of OUT)


def _received(conn: Connection) -> bytes | None:
    """The child's next message, or None when it has ended (its end of the pipe closed with it)."""
    try:
        return conn.recv_bytes()
    except EOFError:
        return None


def _child(
    conn: Connection, job: Job, threads: int, key: str, media: bytes, roles: dict[str, bytes], window: int | None
) -> None:
    """The child: settle in (`_settle`), decode the sample, send back what it made or its error, end."""
    _settle(threads)
    fault_point(STARTING_POINT)
    conn.send_bytes(b"")  # ready: a death from here on is on this sample
    fault_point(SUSPECT_POINT, key)
    answer: tuple[bool, Decoded | Exception]
    try:
        answer = (True, decode_media(media, roles, window, job))
    except Exception as exc:  # noqa: BLE001 - the sample's own error, sent back as itself where it can cross
        answer = (False, crossable(exc))
    conn.send_bytes(pickle.dumps(answer))
    conn.close()


def _settle(threads: int) -> None:
    """Ignore the signals that stop a run, die with the thread that started this process, be the out-of-memory
    killer's first pick, compute on `threads` intra-op threads (the parent's thread's: the same bytes)."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)
    if (with_parent := die_with_parent(signal.SIGKILL)) is not None:
        with_parent()
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # gone before the parent-death signal was asked for
        os._exit(1)
    try:
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as fh:
            fh.write(str(OOM_FIRST))
    except OSError:
        logger.debug("no oom_score_adj here: the out-of-memory killer picks as it would")
    torch.set_num_threads(threads)
