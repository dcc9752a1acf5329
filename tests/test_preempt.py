"""Preemption and a full disk, through a real `latentforge build`.

Stopped by SIGTERM or Ctrl-C (chosen by progress: the first journalled sample), a build seals what is done, exits
within its grace with the preempted exit code and one resume line, and leaves no process, temp file or lock record
behind; the same command again finishes the cache with the same bytes. A build whose disk fills mid-run (a real
small tmpfs) stops with one clear error naming the cache's size and the free space, leaves no partial file, and
resumes once space is freed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.lock import LOCK_NAME
from infra.errors import EXIT_PREEMPTED
from infra.faults import HOLD_ENV
from infra.ops import ephemeral, preempt
from infra.storage import TEMP_SUFFIX
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 4  # held after the first journalled sample, signalled there: some are always left undone
GRACE_S = 20
WAIT_S = 180  # a fresh Prefect home's first ephemeral start takes 10-15 s, more on a busy machine


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips["bikes"], 13, width=96), cut_clip(clips["carphone"], 13, width=96)]
    samples = [sample(i % 2, i, videos[i % 2], f"clip {i}: something moves".encode()) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("preempt-src"), {"shard-a": samples})


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One Prefect home for the module's builds: a reused home starts its ephemeral API faster than a fresh one."""
    return tmp_path_factory.mktemp("preempt-prefect-home")


@pytest.fixture(scope="module")
def reference(source, tiny_model, tmp_path_factory) -> Path:
    """The same build, uninterrupted (in this process, on the session's Prefect harness)."""
    out = tmp_path_factory.mktemp("preempt-ref") / "out"
    ok, result = run_build(config(source, tiny_model, out, workers=1))
    assert ok and result["done"] == SAMPLES, result
    return out


def _build(src: Path, model: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(model),
        "--out", str(out), "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0",
        "--grace-seconds", str(GRACE_S),
    ]  # fmt: skip


def _until(ready, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := ready():
            return value
        if proc.poll() is not None:
            pytest.fail(f"the build exited ({proc.returncode}) before {what}")
        time.sleep(0.02)
    pytest.fail(f"no {what} within {WAIT_S} s")


def _journalled(out: Path) -> bool:
    for journal in (out / "ledger").glob("*.journal.jsonl"):
        with contextlib.suppress(FileNotFoundError):
            if b'"key"' in journal.read_bytes():  # a row (a mark, its sample starting, names no key)
                return True
    return False


def _session(sid: int) -> list[str]:
    """Live processes of session `sid` (the build was started as its leader), and the build's own server."""
    alive = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:160]}")
    return alive


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pt_hashes(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.pt"))}


def _facts(out: Path) -> dict[str, tuple]:
    rows = ledger.read_all(out).items()
    return {f"{s}/{k}": (r.status, r.reason, r.path, r.bytes, r.sha256) for s, rs in rows for k, r in rs.items()}


def _assert_stopped_cleanly(out: Path, stderr: str, server_pid: int, sid: int) -> list[ledger.LedgerRow]:
    """What every preempted build must leave: one resume line, sealed ledgers that match the files, nothing else."""
    resume = [line for line in stderr.splitlines() if preempt.RESUME in line]
    assert len(resume) == 1 and resume[0].startswith("error: interrupted by SIG"), stderr[-3000:]
    assert not list((out / "ledger").glob("*.journal.jsonl")), "a journal was left unsealed"
    sealed = ledger.read_all(out)
    done = [row for rows in sealed.values() for row in rows.values() if row.status == "done"]
    assert done, "nothing was sealed"
    assert all(row.status == "done" for rows in sealed.values() for row in rows.values())
    for row in done:
        path = out / row.path
        assert path.stat().st_size == row.bytes and hashlib.sha256(path.read_bytes()).hexdigest() == row.sha256
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.pt")) == sorted(row.path for row in done)
    assert not list(out.parent.rglob(f"*{TEMP_SUFFIX}")), "a temp file is left"
    assert (out / LOCK_NAME).read_text() == "", "the writer lock's record was not cleared"
    deadline = time.monotonic() + 10
    while (not _gone(server_pid) or _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(server_pid), "the ephemeral Prefect server outlived the preempted build"
    assert not _session(sid), f"processes of the preempted build are left: {_session(sid)}"
    return done


def _start(cmd: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen:
    with (logs / "build.err").open("wb") as err:
        return subprocess.Popen(cmd, env=env, cwd=logs, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _server_of(home: Path, proc: subprocess.Popen) -> int | None:
    return next((r.server_pid for _, r in ephemeral.read_records(home) if r and r.owner_pid == proc.pid), None)


@pytest.mark.slow
def test_sigterm_seals_what_is_done_exits_75_in_the_grace_and_the_same_command_resumes(
    tmp_path, tiny_model, source, reference, home
):
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    hold = logs / "hold"  # the build waits after its first journalled sample until the signal is sent
    hold.touch()
    env, cmd = cli_env(home) | {HOLD_ENV: f"sample={hold}"}, _build(source, tiny_model, out)
    build = _start(cmd, env, logs)
    try:
        server_pid = _until(lambda: _server_of(home, build), build, "a recorded ephemeral server")
        _until(lambda: _journalled(out), build, "a journalled sample")
        assert _server_of(home, build) == server_pid  # one embedded server for the whole run
        build.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(1)  # the handler has run: the shard loop, let go, stops at its next sample
        hold.unlink()
        returncode = build.wait(timeout=GRACE_S + 30)
        stopped_in = time.monotonic() - signalled
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(build.pid, signal.SIGKILL)
    stderr = (logs / "build.err").read_text(errors="replace")
    print(f"SIGTERM → exit {returncode} in {stopped_in:.1f} s")
    assert returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert stopped_in < GRACE_S, f"took {stopped_in:.1f} s, grace {GRACE_S} s"
    assert "grace period" not in stderr  # the graceful path, not the watchdog
    # its API was its own embedded server, not Prefect's own start, and no link to a UI it lacks
    assert "Starting temporary server" not in stderr and "View at" not in stderr
    done = _assert_stopped_cleanly(out, stderr, server_pid, build.pid)
    assert len(done) < SAMPLES, "the build finished before the signal: nothing was interrupted"

    started = time.monotonic()
    rerun = CliRunner().invoke(app, cmd[cmd.index("build") :])  # the same command, in this process (saves a start)
    print(f"{len(done)} of {SAMPLES} samples sealed; the rerun took {time.monotonic() - started:.1f} s")
    assert rerun.exit_code == 0, rerun.output[-3000:]
    counts = re.search(r"samples\s+(\d+): (\d+) done \((\d+) encoded now, (\d+) reused\)", rerun.stdout)
    assert counts and counts.groups() == tuple(map(str, (SAMPLES, SAMPLES, SAMPLES - len(done), len(done)))), (
        rerun.output
    )
    assert _pt_hashes(out) == _pt_hashes(reference) and len(_pt_hashes(out)) == SAMPLES
    assert _facts(out) == _facts(reference)
    assert not list(out.rglob(f"*{TEMP_SUFFIX}"))


@pytest.mark.slow
@pytest.mark.soak
def test_a_second_ctrl_c_ends_the_build_at_once_still_sealed_and_resumable(
    tmp_path, tiny_model, source, reference, home
):
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    hold = logs / "hold"  # held after its first journalled sample: the graceful stop cannot finish first
    hold.touch()
    env, cmd = cli_env(home) | {HOLD_ENV: f"sample={hold}"}, _build(source, tiny_model, out)
    build = _start(cmd, env, logs)
    try:
        server_pid = _until(lambda: _server_of(home, build), build, "a recorded ephemeral server")
        _until(lambda: _journalled(out), build, "a journalled sample")
        os.killpg(build.pid, signal.SIGINT)  # what Ctrl-C at a terminal does: the whole foreground group
        _until(lambda: "stopping after the samples in flight" in (logs / "build.err").read_text(), build, "the stop")
        with contextlib.suppress(ProcessLookupError):  # gone already: the graceful stop won the race
            os.killpg(build.pid, signal.SIGINT)
        signalled = time.monotonic()
        hold.unlink()
        returncode = build.wait(timeout=GRACE_S + 30)
        stopped_in = time.monotonic() - signalled
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(build.pid, signal.SIGKILL)
    stderr = (logs / "build.err").read_text(errors="replace")
    print(f"second SIGINT → exit {returncode} in {stopped_in:.2f} s")
    assert returncode == EXIT_PREEMPTED, stderr[-3000:]
    if "second signal (SIGINT): stopping now" not in stderr:
        pytest.skip("the graceful stop finished before the second Ctrl-C landed: the immediate exit was not reached")
    assert stopped_in < 5, f"a second signal took {stopped_in:.1f} s"
    _assert_stopped_cleanly(out, stderr, server_pid, build.pid)

    ok, result = run_build(config(source, tiny_model, out, workers=1))  # resumes (here, on the harness)
    assert ok and result["done"] == SAMPLES, result
    assert _pt_hashes(out) == _pt_hashes(reference)
    assert _facts(out) == _facts(reference)


# --- a full disk ----------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path) -> Path:
    """A real 2 MiB file system (tmpfs), mounted for this test: where ENOSPC really happens."""
    mount = tmp_path / "small"
    mount.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]
    made = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if made.returncode != 0:
        why = made.stderr.strip() or f"exit {made.returncode}"
        pytest.skip(f"cannot mount a tmpfs here ({why}): the disk-full test needs root or CAP_SYS_ADMIN")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> int:
    """Write `path` until its file system is full; the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            written += fh.write(b"\0" * 4096)
    return written


def test_a_full_disk_stops_the_build_naming_sizes_leaves_no_partial_file_and_resumes(
    small_fs, tiny_model, source, reference, tmp_path, monkeypatch
):
    out, ballast, hold = small_fs / "out", small_fs / "someone-elses-file", tmp_path / "hold"
    hold.touch()  # the build waits after its first journalled sample until the disk is full
    monkeypatch.setenv(HOLD_ENV, f"sample={hold}")
    filled: list[int] = []

    def fill_once_a_sample_is_journalled() -> None:
        deadline = time.monotonic() + WAIT_S
        while not _journalled(out) and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.005)
        filled.append(_fill(ballast))  # another process takes the rest of the disk mid-run
        hold.unlink()

    stop = threading.Event()
    filler = threading.Thread(target=fill_once_a_sample_is_journalled, daemon=True)
    filler.start()
    try:
        ok, result = run_build(config(source, tiny_model, out, workers=1))
    finally:
        stop.set()
        filler.join(timeout=30)
    assert filled, "the disk was never filled"
    assert not ok, f"the build finished before the disk filled: {result}"
    print(f"filled {filled[0]} bytes mid-run; the run said: {result}")
    found = re.search(r"disk full: .*the cache \S+ holds (\d+) bytes .* and (\d+) bytes .* free on", str(result))
    assert found, result
    assert 0 < int(found.group(1)) <= 2 << 20 and int(found.group(2)) < 64 << 10
    assert "run the same command again" in str(result)

    # Stopped cleanly: no temp file, no failed row, every done row's file whole; files without a row load as ours.
    assert not list(small_fs.rglob(f"*{TEMP_SUFFIX}")), "a partial file is left"
    rows = [row for rows in ledger.read_all(out).values() for row in rows.values()]
    assert rows and all(row.status == "done" for row in rows), [(r.status, r.reason, r.detail) for r in rows]
    for row in rows:
        assert hashlib.sha256((out / row.path).read_bytes()).hexdigest() == row.sha256
    for pt in out.rglob("*.pt"):
        assert torch.load(pt, weights_only=True)["x0"].numel() > 0  # a partial file would not load

    ballast.unlink()  # space is freed
    ok, result = run_build(config(source, tiny_model, out, workers=1))
    assert ok and result["done"] == SAMPLES, result
    assert _pt_hashes(out) == _pt_hashes(reference)
    assert _facts(out) == _facts(reference)
    assert not list(small_fs.rglob(f"*{TEMP_SUFFIX}"))
