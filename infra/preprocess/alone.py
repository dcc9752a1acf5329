"""A suspect decoded and prepared alone, in a child process (`infra.preprocess.inflight`): what can take a process
down on a sample's bytes (a decoder's segfault, a decompression bomb's out-of-memory kill) takes the child down, and
the run goes on with the proof.

The sample's bytes are read here, as for any sample (reads are bounded: the cap is checked before the bytes arrive). The
child decodes and prepares them with the code every decoder runs (`infra.preprocess.prepare.decode_media`, under the
same limits) on as many intra-op threads as the run would have decoded it with where nothing died (a read-ahead
decoder's team: `infra.preprocess.decoders.decoding_team`; the calling thread's by default): the same bytes (the
resize's rounding depends on how its rows are split among threads: at 33x256², 1 and 2 threads differ by 6e-8), and
sends back what it made, pickled whole (no shared memory that a dead parent could leave behind), or the sample's own
error (an `InputError` as itself). This process makes the `PreparedSample` of it, as with a decoder process's answer.

A child that ends without an answer (killed by a signal, or an exit) is started once more, fresh: a death on the
sample, twice in a row with nothing else in the child, is the proof (`ChildKilled`, each death's process and signal).
A death counts only once the child has said it is ready (started, its job and the sample's bytes taken, about to
decode): a child that cannot start (an import that fails, the OOM killer picking it while it imports) says nothing
of the sample, and fails it as an ``encode_error`` (retried by the same command), never as ``killed_run``. Both
deaths happen in one run: a run that dies between them leaves its mark, and the next run starts the count again.
The child is a fresh interpreter (``python -m infra.preprocess.alone``: no fork of a process that holds torch's and
Prefect's threads, and none of the run's own modules but the decoders' to import: about 2 CPU-s), takes its request
on stdin and answers on stdout, ignores the signals that stop a run (stopping is the shard's, between samples), and is
killed when the thread that started it ends (Linux's parent-death signal: a run killed from outside leaves no child
decoding on). It is given no preference with the kernel's out-of-memory killer: one acting for another process picks
by size, as for any process (a child made the first pick would be killed, twice, for another's memory: a false
proof). There is no time bound beyond the decoders' own (a clip over ``--max-pixels`` / ``--max-frames`` is refused
before it is decoded), as for any decoder.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
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
#: The child's command: ``python -m`` this module (nothing else of the run imported: torch, the decoders).
CHILD_MODULE = "infra.preprocess.alone"
#: What the child writes first, once it is ready to decode.
READY = b"ready\n"


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


def prepare_alone(raw: RawSample, job: Job, threads: int | None = None) -> PreparedSample:
    """`prepare(raw, job)`, its decode in a child process (started again once if it dies) on `threads` intra-op
    threads (None: as many as the calling thread: `prepare`'s bytes on this thread); raises what preparing raises (an
    InputError for bad input), `ChildKilled` when every child died on it, or a RuntimeError when a child died before
    it was ready (no proof)."""
    threads = torch.get_num_threads() if threads is None else threads
    deaths: list[Death] = []
    for _ in range(TRIES):
        answer = _in_child(raw, job, threads)
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


def _in_child(raw: RawSample, job: Job, threads: int) -> tuple[bool, Any] | Death:
    """One child's answer: (True, `Decoded`), (False, the sample's error), or its `Death`."""
    request = pickle.dumps((job, threads, raw.ref.key, raw.media, raw.roles, raw.ref.window))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's modules
    command = [sys.executable, "-m", CHILD_MODULE, str(os.getpid())]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # stderr: the run's
    out, _ = child.communicate(request)
    started = out.startswith(READY)
    if child.returncode != 0 or not started:
        return Death(child.pid, child.returncode, started=started)
    return pickle.loads(out[len(READY) :])  # this process's own child's answer, through its own pipe (no file of OUT)


def _serve(parent: int) -> None:
    """The child (``python -m infra.preprocess.alone PARENT_PID``): take the request from stdin, settle in, say it is
    ready, decode, write back what it made or the sample's error; stdout is the answer's alone (anything else printed
    goes to stderr)."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _settle(parent)
    job, threads, key, media, roles, window = pickle.load(sys.stdin.buffer)  # the parent's own request
    torch.set_num_threads(threads)
    fault_point(STARTING_POINT)
    answers.write(READY)  # a death from here on is on this sample
    answers.flush()
    fault_point(SUSPECT_POINT, key)
    answer: tuple[bool, Decoded | Exception]
    try:
        answer = (True, decode_media(media, roles, window, job))
    except Exception as exc:  # noqa: BLE001 - the sample's own error, sent back as itself where it can cross
        answer = (False, crossable(exc))
    answers.write(pickle.dumps(answer))
    answers.close()


def _settle(parent: int) -> None:
    """Ignore the signals that stop a run, and die with the `parent` (a parent-death signal; gone already: end)."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)
    if (with_parent := die_with_parent(signal.SIGKILL)) is not None:
        with_parent()
    if os.getppid() != parent:  # it died before the parent-death signal was asked for
        os._exit(1)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
