"""Crashes and concurrent writers: a kill at any point leaves only whole files, a rerun finishes the job
with the same bytes as an uninterrupted run, and two runs never write one OUT at once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.lock import LOCK_NAME, out_lock
from infra.storage import TEMP_SUFFIX, atomic_write, remove_stale_temps
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]
LATENTFORGE = Path(sys.executable).parent / "latentforge"

WRITER = """
import sys
from pathlib import Path
from infra.storage import atomic_write
atomic_write(Path(sys.argv[1]), b"\\xa5" * int(sys.argv[2]))
"""


def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{TEMP_SUFFIX}"))


def _group_survivors(pgid: int) -> list[str]:
    """Live (non-zombie) processes whose process group is `pgid`: '<pid> <state> <cmdline>'."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text[text.rindex(")") + 2 :].split()  # state ppid pgrp ...
            if int(fields[2]) == pgid and fields[0] != "Z":  # a zombie is dead, only not yet reaped
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                alive.append(f"{stat.parent.name} {fields[0]} {cmdline[:200]}")
        except OSError:  # the process went away while we looked
            continue
    return alive


def _wait_group_gone(pgid: int, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (alive := _group_survivors(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _pt_hashes(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.pt"))}


def _ledger_facts(out: Path) -> dict[str, tuple]:
    return {
        f"{shard}/{key}": (row.status, row.reason, row.path, row.bytes, row.sha256)
        for shard, rows in ledger.read_all(out).items()
        for key, row in rows.items()
    }


# --- atomic_write ---------------------------------------------------------------------------------------


def test_a_writer_killed_mid_file_leaves_no_partial_file_under_the_final_name(tmp_path):
    size = 256 << 20  # big enough that write + fsync take a while, small enough for a shared machine
    target = tmp_path / "sample.pt"
    caught_mid_write = False
    for attempt in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(target), str(size)],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 120
            while not _temps(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            seen_temp = bool(_temps(tmp_path))
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone already if it won the race
                os.killpg(proc.pid, signal.SIGKILL)
            stderr = proc.communicate(timeout=60)[1].decode(errors="replace")
        assert proc.returncode in (0, -signal.SIGKILL), f"writer failed on its own: {stderr}"

        if target.exists():
            # The writer won the race: the final name may exist only as the whole file.
            assert target.stat().st_size == size, "a partial file is visible under the final name"
            with target.open("rb") as fh:
                assert all(chunk == b"\xa5" * len(chunk) for chunk in iter(lambda: fh.read(1 << 24), b""))
            target.unlink()
            remove_stale_temps(tmp_path)
            continue
        if not seen_temp:
            pytest.fail(f"attempt {attempt}: the writer neither created a temp file nor the target: {stderr}")

        # Killed between creating the temp and linking it: only the temp is left, under its hidden name.
        caught_mid_write = True
        leftovers = _temps(tmp_path)
        assert len(leftovers) == 1, leftovers
        assert leftovers[0].name.startswith(f".{target.name}.")
        assert leftovers[0].stat().st_size <= size
        assert sorted(p.name for p in tmp_path.iterdir()) == [leftovers[0].name]
        assert remove_stale_temps(tmp_path) == 1
        assert list(tmp_path.iterdir()) == []
        assert remove_stale_temps(tmp_path) == 0
        break
    assert caught_mid_write, "five kills all came after the write finished: the crash case was never exercised"


def test_atomic_write_never_clobbers_unless_asked(tmp_path):
    target = tmp_path / "deep" / "dir" / "x.pt"
    first = atomic_write(target, b"first version")
    assert first.path == target and target.read_bytes() == b"first version"
    assert first.bytes == len(b"first version")
    assert first.sha256 == hashlib.sha256(b"first version").hexdigest()

    with pytest.raises(FileExistsError, match="not overwriting"):
        atomic_write(target, b"a second writer")
    assert target.read_bytes() == b"first version"

    payload = os.urandom(100_000)
    second = atomic_write(target, payload, replace=True)
    assert target.read_bytes() == payload
    assert (second.bytes, second.sha256) == (len(payload), hashlib.sha256(payload).hexdigest())
    assert _temps(target.parent) == []  # neither the refused nor the replacing write left a temp behind


# --- a real build, killed -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crash_source(clips, tmp_path_factory) -> Path:
    """Two shards of three short real clips each: a few seconds of encoding in all."""
    videos = [
        cut_clip(clips["bikes"], 20, width=160),
        cut_clip(clips["carphone"], 20, width=160),
        cut_clip(clips["bigbuckbunny"], 20, width=160),
    ]
    samples = [
        sample(i % 2, i, videos[i % 3], f"clip {i}: something moves across the frame".encode()) for i in range(6)
    ]
    return make_shards(tmp_path_factory.mktemp("crash-src"), {"shard-a": samples[:3], "shard-b": samples[3:]})


def _cli(src: Path, model: Path, out: Path) -> list[str]:
    return [
        str(LATENTFORGE), "build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out),
        "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--workers", "1",
    ]  # fmt: skip


def _journal_has_a_row(out: Path) -> bool:
    for journal in (out / "ledger").glob("*.journal.jsonl"):
        with contextlib.suppress(FileNotFoundError):  # sealed and removed since the glob
            if b'"key"' in journal.read_bytes():  # a row (a mark, its sample starting, names no key)
                return True
    return False


def _kill_mid_run(cmd: list[str], env: dict[str, str], out: Path, logs: Path) -> tuple[int, str]:
    """Start the CLI, SIGKILL its whole process group once a sample is journalled: (returncode, stderr)."""
    with (logs / "killed.out").open("wb") as stdout, (logs / "killed.err").open("wb") as stderr:
        proc = subprocess.Popen(cmd, env=env, cwd=logs, start_new_session=True, stdout=stdout, stderr=stderr)
        try:
            deadline = time.monotonic() + 150
            while proc.poll() is None and time.monotonic() < deadline and not _journal_has_a_row(out):
                time.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the CLI (its embedded server ends by its parent-death signal)
            proc.wait(timeout=60)
    survivors = _wait_group_gone(proc.pid)
    assert not survivors, f"processes of the killed run survive: {survivors}"
    return proc.returncode, (logs / "killed.err").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.soak  # one kill point of the sweep in test_crash_sweep.py, which runs them all in make soak
def test_a_killed_build_resumes_to_the_same_bytes_as_an_uninterrupted_one(tmp_path, tiny_model, crash_source):
    env = cli_env(tmp_path / "prefect-home")
    out = tmp_path / "out"
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        returncode, stderr = _kill_mid_run(_cli(crash_source, tiny_model, out), env, out, tmp_path)
        sealed = [p for p in out.glob("ledger/*.jsonl") if not p.name.endswith(".journal.jsonl")]
        if returncode == -signal.SIGKILL and len(sealed) < 2:
            break  # killed mid-run, as intended
        assert returncode in (0, -signal.SIGKILL), f"the build failed before it could be killed:\n{stderr[-3000:]}"
    else:
        pytest.fail("three builds all finished before the kill: the crash case was never exercised")

    # What the crash left: only whole sample files, each one this spec's.
    fingerprint = json.loads((out / "cache.json").read_text())["fingerprint"]
    done_before = [row for rows in ledger.read_all(out).values() for row in rows.values() if row.status == "done"]
    assert done_before, "the kill came before any sample was journalled"
    for pt in out.rglob("*.pt"):
        record = torch.load(pt, weights_only=True)  # a partial file would not load
        assert record["fingerprint"] == fingerprint
    # Whether or not this kill landed mid-write, leave what one that did would: a partial temp file.
    stale = out / "O-21_ball_trajectory_data-generator" / f".ball_trajectory_00000005.pt.0123456789ab{TEMP_SUFFIX}"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"PK\x03\x04 half a torch file")

    rerun = subprocess.run(
        _cli(crash_source, tiny_model, out), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    counts = re.search(r"samples\s+(\d+): (\d+) done \((\d+) encoded now, (\d+) reused\)", rerun.stdout)
    assert counts, rerun.stdout
    samples, done, encoded, reused = map(int, counts.groups())
    assert (samples, done) == (6, 6), rerun.stdout
    # files written after the last journal line are adopted (fingerprint checked), not re-encoded: also reuse
    assert reused >= len(done_before) >= 1, f"the rerun did not reuse the {len(done_before)} samples done before"
    assert encoded == 6 - reused, rerun.stdout

    reference = tmp_path / "reference"
    ok, result = run_build(config(crash_source, tiny_model, reference, workers=1))
    assert ok, result
    assert result["done"] == 6

    hashes = _pt_hashes(out)
    assert len(hashes) == 6
    assert hashes == _pt_hashes(reference)
    assert _ledger_facts(out) == _ledger_facts(reference)
    assert not list(out.rglob(f"*{TEMP_SUFFIX}")), "temp files survived the rerun"
    assert not list((out / "ledger").glob("*.journal.jsonl")), "the rerun left unsealed journals"


# --- two writers ----------------------------------------------------------------------------------------


def test_a_second_build_on_a_locked_out_is_refused_and_writes_nothing(tmp_path, tiny_model, clips):
    video = cut_clip(clips["carphone"], 9, width=96)
    src = make_shards(tmp_path / "src", {"shard-00000": [sample(0, 0, video, b"A man talks in a car.")]})
    out = tmp_path / "out"
    with out_lock(out):
        ok, result = run_build(config(src, tiny_model, out))
        assert not ok
        assert "being written by another run" in str(result)
        assert f"pid {os.getpid()}" in str(result)
        assert sorted(p.name for p in out.rglob("*")) == [LOCK_NAME]  # no cache.json, ledger or sample

    ok, result = run_build(config(src, tiny_model, out))  # the lock went with its holder
    assert ok, result
    assert result["done"] == 1
