"""Decode-ahead: a new build's first shard decoded, sampled and resized by a process of its own from the run's start.

A terminal build spends its first ~15 s importing (torch, diffusers, transformers, Prefect's engines: one core, the
GIL) while the embedded Prefect server starts on the other core and then idles. `start` forks the build's process
once the decoders are imported (before any thread exists, and before Prefect's engines are imported) and the child
decodes the first shard's samples in the order the shard visits them, with the recipe's own `prepare_video`. The
child is a process, so its decoding never waits for the GIL that the imports, and later the encoder, hold.

Each result waits as a file in a private directory (``/dev/shm`` where there is one), at most ``decode_ahead_mb``
MiB of them unconsumed (the child waits for room). `take` is the prefetcher's and the sanity's way in
(`infra.preprocess.encode.prepared_video`): it returns the child's result for a sample only when the result names
the same sample key, the same recipe (spec, window, limits) and the sha256 of every byte the consumer read (the
source's ``identity.read_sha256``, as `infra.preprocess.handoff` compares them); anything else is decoded by the
consumer as before. Decoding is deterministic (`tests/test_fidelity.py`), so the
bytes written are the same either way (`tests/test_ahead.py`). A sample is claimed by whoever asks first (an
``O_EXCL`` file): the child never decodes a sample a consumer has begun, and a consumer waits for a sample the child
has begun instead of decoding it twice. A sample whose decoding fails in the child is decoded by its consumer, which
then records its own error.

Not used (each decodes as before): off Linux, with threads already running (a test's or a notebook's process),
``--dry-run``, ``--runner ray``, ``--only``, an OUT that exists and is not empty (a resume: its rows may be done),
``windows:K`` (made from the clip as it is visited), ``--decode-ahead-mb 0``. The child ignores Ctrl-C (the run's
own stop handling ends it), dies with the run (``PR_SET_PDEATHSIG``; SIGKILL included), runs at a lower priority
(``nice`` +10: it takes what is idle, yet never starves) and writes nothing to the terminal. Once it has decoded
the shard it marks its directory ended (no consumer waits for it any more) and becomes a small shell (`WATCH`)
that holds none of the decoders' memory and removes the directory if the run dies. `stop` ends it and removes its
directory. The child decodes until the shard's own read-ahead starts (`hand_over`): from then on both cores are
the run's, and the child's memory would only add to the run's peak.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import itertools
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infra.config import BuildConfig, CacheSpec
    from infra.media.video import MediaLimits
    from infra.sources import SampleRef

logger = logging.getLogger(__name__)

PREFIX = "latentforge-ahead-"
ENDED = "ended"  # written by the child when it decodes no more
HANDOVER = "handover"  # written by the run when its own decoding starts (`hand_over`)
NICE = 10
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.005


@dataclass
class _Child:
    pid: int
    directory: Path
    answered: set[str] = field(default_factory=set)  # samples already asked for (taken, refused or claimed)
    taken: int = 0
    exited: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_child: _Child | None = None
_lock = threading.Lock()


def wanted(config: BuildConfig, spec: CacheSpec) -> str | None:
    """None when this build decodes ahead; otherwise why not."""
    out = Path(config.out).expanduser()
    reasons = [
        (not sys.platform.startswith("linux") or not hasattr(os, "fork"), "not Linux"),
        (config.decode_ahead_mb <= 0, "--decode-ahead-mb 0"),
        (config.dry_run, "a dry run"),
        (config.runner != "local", "the shards run on Ray"),
        (config.only is not None, "--only"),
        (spec.temporal_policy().kind == "windows", "windows:K samples"),
        (out.exists() and (not out.is_dir() or any(out.iterdir())), "OUT is not new"),
        (threading.active_count() > 1, f"threads are running: {[t.name for t in threading.enumerate()]}"),
    ]
    return next((why for cond, why in reasons if cond), None)


def start(config: BuildConfig, spec: CacheSpec) -> bool:
    """Fork the decode-ahead child for this build (`wanted`); True when it runs. Call from the main thread, with
    the decoders imported and nothing else running."""
    global _child
    why = wanted(config, spec)
    with _lock:
        if _child is not None:
            why = why or "one runs already"
        if why is not None:
            logger.debug("decode-ahead: off (%s)", why)
            return False
        base = base_directory()
        _sweep(base)
        directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns, never runs the parent's exit handlers
            code = 0
            try:
                _run_child(config, spec, directory, parent)
            except BaseException:  # noqa: BLE001 - the parent decodes whatever this did not
                code = 1
            _end_child(directory, parent, code)
        _child = _Child(pid, directory)
    atexit.register(stop)
    logger.debug("decode-ahead: pid %d, %s", pid, directory)
    return True


def base_directory() -> Path:
    """Where the children's directories go: ``/dev/shm`` (memory) where it can be written, else the temp dir."""
    return Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def take(ref: SampleRef, spec: CacheSpec, limits: MediaLimits) -> Any | None:
    """The child's prepared video of `ref` (a `PreparedVideo` without source frames), or None: the caller decodes
    it. `ref` has been read (its ``identity.read_sha256`` is that of the caller's bytes). Waits while the child is
    decoding it."""
    child = _child
    if child is None or not ref.identity.read_sha256:
        return None
    with child.lock:
        if ref.key in child.answered:
            return None
        child.answered.add(ref.key)
    path = child.directory / _name(ref.key)
    try:
        if _claim(path):
            return None  # nobody decodes it: the caller does, and the child now leaves it
    except OSError:
        return None  # the directory is gone (stopped)
    return _wait_for(child, path, ref, _recipe(spec, ref.window, limits))


def hand_over() -> None:
    """The run's own decoding has started (the shard's read-ahead, on the core the start-up left idle): the child
    finishes the sample in hand and ends, so that its memory is not held beside the run's at the run's peak; what
    it has decoded still waits for the run."""
    child = _child
    if child is not None:
        with contextlib.suppress(OSError):
            (child.directory / HANDOVER).touch()


def stop() -> dict[str, int] | None:
    """End the child and remove its directory: {"taken": samples used}, or None when none ran."""
    global _child
    with _lock:
        child, _child = _child, None
    if child is None:
        return None
    if not _reaped(child):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while not _reaped(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not _reaped(child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)
    shutil.rmtree(child.directory, ignore_errors=True)
    logger.info("decode-ahead: %d sample(s) decoded by the start-up process and used", child.taken)
    return {"taken": child.taken}


# ----------------------------------------------------------------------------- the consumer's side


def _wait_for(child: _Child, path: Path, ref: SampleRef, recipe: str) -> Any | None:
    done, failed, ended = path.with_suffix(".pkl"), path.with_suffix(".fail"), child.directory / ENDED
    while not done.exists():
        if failed.exists() or ended.exists() or _reaped(child):
            if done.exists():
                break  # written just before the child ended
            return None
        time.sleep(_POLL_S)
    try:
        with done.open("rb") as f:
            payload = pickle.load(f)  # our own child's file, in a directory only this user can read
        done.unlink()
    except (OSError, pickle.UnpicklingError, EOFError):
        return None
    if (payload.get("key"), payload.get("recipe"), payload.get("read_sha256")) != (
        ref.key,
        recipe,
        ref.identity.read_sha256,
    ):
        return None  # not what this consumer read or asks for: it decodes the sample itself
    with child.lock:
        child.taken += 1
    return payload["video"]


def _reaped(child: _Child) -> bool:
    """Whether the child has exited (reaped here: it is this process's child)."""
    with child.lock:
        if not child.exited:
            try:
                pid, _ = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                pid = child.pid
            child.exited = pid == child.pid
        return child.exited


def _claim(path: Path) -> bool:
    """Claim the sample of `path` for this process: True when no one had (an ``O_EXCL`` file)."""
    try:
        os.close(os.open(path.with_suffix(".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def _name(key: str) -> str:
    return hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()[:20] + ".x"


def _recipe(spec: CacheSpec, window: int | None, limits: MediaLimits) -> str:
    """Everything a sample's pixels depend on besides its bytes."""
    text = f"{spec.model_dump_json()}|{window}|{limits.max_pixels}|{limits.max_frames}"
    return hashlib.sha256(text.encode()).hexdigest()


def _sweep(base: Path) -> None:
    """Remove the directories of decode-ahead children whose run is gone (a run killed before its exit handlers)."""
    for stale in base.glob(f"{PREFIX}*-*"):
        pid = stale.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- the child


def _run_child(config: BuildConfig, spec: CacheSpec, directory: Path, parent: int) -> None:
    """Decode the first shard's samples into `directory` until done, or until the run ends."""
    _become_child(directory, parent)
    from infra.heap import trim  # noqa: PLC0415
    from infra.media.video import MediaLimits  # noqa: PLC0415
    from infra.plan import plan_shards  # noqa: PLC0415 - imported already by the parent's plan
    from infra.preprocess.encode import prepare_pixels, read_sample  # noqa: PLC0415
    from infra.sources import open_source  # noqa: PLC0415

    source = open_source(config.source)
    shards = plan_shards(config, source)
    if not shards:
        return
    first, limits = shards[0], MediaLimits(max_pixels=config.max_pixels, max_frames=config.max_frames)
    budget = config.decode_ahead_mb * 2**20
    samples = source.samples(first.shard)
    handover = directory / HANDOVER
    for ref in itertools.islice(samples, 0, first.quota):
        while _pending(directory) >= budget and not handover.exists():
            if os.getppid() != parent:
                return
            time.sleep(0.02)
        if os.getppid() != parent or handover.exists():
            return
        path = directory / _name(ref.key)
        if not _claim(path):
            continue  # its consumer asked first and decodes it
        try:
            _, media = read_sample(ref)  # fills ref.identity.read_sha256
            video = prepare_pixels(media, spec, ref.window, limits)
        except Exception:  # noqa: BLE001 - its consumer decodes it and records its own error
            path.with_suffix(".fail").touch()
            continue
        recipe = _recipe(spec, ref.window, limits)
        payload = {"key": ref.key, "recipe": recipe, "read_sha256": dict(ref.identity.read_sha256), "video": video}
        partial = path.with_suffix(".part")
        with partial.open("wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        partial.rename(path.with_suffix(".pkl"))
        del video, payload
        trim()  # the clip's decoder buffers, freed, back to the OS: the run's peak comes while this one decodes


#: What a child that has decoded its shard becomes (``sh -c WATCH sh DIRECTORY RUN_PID``): its results wait for the
#: run, and its directory must go with the run, a SIGKILLed run included (the parent-death signal, kept across
#: exec, or the run's pid gone). A shell holds ~1 MB where the decoding process held its decoders' memory.
WATCH = """trap 'rm -rf "$1"; kill $! 2>/dev/null; exit 0' TERM
while kill -0 "$2" 2>/dev/null; do sleep 1 & wait $!; done
rm -rf "$1"
"""


def _end_child(directory: Path, parent: int, code: int) -> None:
    """Mark the child's work ended (consumers stop waiting for samples it claimed and did not finish) and become
    a shell that removes the directory once the run is gone; where no shell runs, wait for that here."""
    with contextlib.suppress(OSError):
        (directory / ENDED).touch()
    with contextlib.suppress(OSError):
        os.execv("/bin/sh", ["sh", "-c", WATCH, "sh", str(directory), str(parent)])
    while os.getppid() == parent:
        time.sleep(0.2)
    shutil.rmtree(directory, ignore_errors=True)  # the run is gone without its exit handlers
    os._exit(code)


def _become_child(directory: Path, parent: int) -> None:
    """Signals, priority, terminal and parent-death set up for the child."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the run's own stop handling ends this process

    def on_term(signum: int, frame: object) -> None:
        # From `stop` (the run removes the directory too) or from the kernel as the run's main thread dies: then
        # `getppid` may still name the run, whose other threads are still exiting, and nobody else removes the files.
        del signum, frame
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        on_term(signal.SIGTERM, None)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    logging.disable(logging.CRITICAL)


def _pending(directory: Path) -> int:
    """Bytes of results waiting for their consumers."""
    total = 0
    for entry in os.scandir(directory):
        if entry.name.endswith((".pkl", ".part")):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat().st_size
    return total
