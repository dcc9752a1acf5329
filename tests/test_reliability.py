"""A killed build leaves nothing running, nothing the next one does not clean up, and one OUT has one writer:
real `latentforge build` processes on their embedded Prefect server, killed by progress, not by the clock; the
reaper of embedded servers whose run is gone, on real processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from infra.cache.lock import LOCK_NAME, LockedError, lock_caveat, out_lock
from infra.faults import HOLD_ENV
from infra.ops import ephemeral
from tests.conftest import FRAMES, HEIGHT, WIDTH, make_shards, sample
from tests.media_utils import cut_clip
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 4  # two shards of two: the kill lands after the first journalled sample, with work left
WAIT_S = 180  # the first ephemeral start on a fresh Prefect home takes 10-15 s, more on a busy machine


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips["bikes"], 13, width=96), cut_clip(clips["carphone"], 13, width=96)]
    samples = [sample(i % 2, i, videos[i % 2], f"clip {i}: something moves".encode()) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("rel-src"), {"shard-a": samples[:2], "shard-b": samples[2:]})


def _build(src: Path, model: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(model),
        "--out", str(out), "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0",
    ]  # fmt: skip


def _until(ready, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (value := ready()) is not None:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the build exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    pytest.fail(f"no {what} within {WAIT_S} s")


def _lock_record(out: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((out / LOCK_NAME).read_text()) or None
    return None


def _journalled(out: Path) -> bool | None:
    for journal in (out / "ledger").glob("*.journal.jsonl"):
        with contextlib.suppress(FileNotFoundError):
            if b'"key"' in journal.read_bytes():  # a row (a mark, its sample starting, names no key)
                return True
    return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(pid: int, port: int) -> list[str]:
    return [
        c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port
    ]


@pytest.mark.slow
@pytest.mark.soak
def test_a_second_build_is_refused_and_a_killed_builds_server_and_lock_are_cleared(tmp_path, tiny_model, source):
    home, out, logs = tmp_path / "prefect-home", tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    env, cmd = cli_env(home), _build(source, tiny_model, out)
    hold = logs / "hold"  # the first build waits after its first journalled sample, holding OUT, until it is killed
    hold.touch()
    with (logs / "first.err").open("wb") as err:
        first = subprocess.Popen(
            cmd, env=env | {HOLD_ENV: f"sample={hold}"}, cwd=logs, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )  # fmt: skip
    t0 = time.monotonic()
    try:
        # 1. The first build holds OUT and its ephemeral server is recorded.
        owner = _until(lambda: r if (r := _lock_record(out)) and r["pid"] == first.pid else None, first, "lock")
        (record,) = [r for _, r in ephemeral.read_records(home) if r.owner_pid == first.pid]
        assert owner["host"] == socket.gethostname()
        assert _listening(record.server_pid, record.port) == ["127.0.0.1"]  # the embedded server: loopback only

        # 2. A second build into the same OUT is refused at once, naming the first's pid and host.
        started = time.monotonic()
        second = subprocess.run(cmd, env=env, cwd=logs, capture_output=True, text=True, timeout=WAIT_S)
        refused_in = time.monotonic() - started
        print(f"lock seen {time.monotonic() - t0:.1f} s after start; refused in {refused_in:.1f} s")
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"pid {first.pid} on {socket.gethostname()}" in second.stderr, second.stderr[-2000:]
        assert "being written by another run" in second.stderr

        # 3. SIGKILL the first build (only it: no hook runs) once a sample is journalled: its embedded server (a
        # session of its own, untouched by a signal to the build's group) ends by its parent-death signal.
        _until(lambda: _journalled(out), first, "a journalled sample")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _alive(record.server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(record.server_pid), "the killed build's embedded server outlived it"
        assert _lock_record(out)["pid"] == first.pid  # the record of a writer that never released

        # 4. The next build drops the dead server's record, takes the lock over and finishes the cache.
        print(f"killed {time.monotonic() - t0:.1f} s after start")
        t1 = time.monotonic()
        rerun = subprocess.run(cmd, env=env, cwd=logs, capture_output=True, text=True, timeout=400)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"taking over the writer lock of {out} left by pid {first.pid}" in rerun.stderr
        assert re.search(rf"samples\s+{SAMPLES}: {SAMPLES} done", rerun.stdout), rerun.stdout
        assert ephemeral.read_records(home) == [], "the rerun's own server record outlived it"
        assert _lock_record(out) is None  # released cleanly: no record left
        print(f"rerun took {time.monotonic() - t1:.1f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # whatever is left of the first build's group


def test_a_lock_record_left_by_another_host_is_refused_with_how_to_clear_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    record = {"pid": 4242, "host": "another-host.example", "create_time": 1.0, "since": "2025-01-01T00:00:00+00:00"}
    (out / LOCK_NAME).write_text(json.dumps(record))
    refused = r"pid 4242 on another-host\.example.*remove .*latentforge\.lock"
    with pytest.raises(LockedError, match=refused), out_lock(out):
        pass
    assert json.loads((out / LOCK_NAME).read_text()) == record  # left for a person to judge


def test_a_held_lock_names_its_holder_and_a_clean_release_leaves_no_record(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with out_lock(out):
        held = json.loads((out / LOCK_NAME).read_text())
        assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
        assert held["create_time"] == psutil.Process().create_time()
        with pytest.raises(LockedError, match=f"pid {os.getpid()} on {socket.gethostname()}"), out_lock(out):
            pass
    assert (out / LOCK_NAME).read_text() == ""
    with out_lock(out):  # and the next writer gets it without a warning
        pass
    fresh = tmp_path / "fresh"
    with out_lock(fresh):  # a lock that made OUT, with nothing else written there (a run stopped at a gate)
        assert fresh.is_dir()
    assert not fresh.exists()
    with out_lock(fresh):
        (fresh / "cache.json").write_text("{}")
    assert sorted(p.name for p in fresh.iterdir()) == [LOCK_NAME, "cache.json"]


Part = namedtuple("Part", "device mountpoint fstype opts")


def test_a_network_file_system_is_named_as_untrustworthy_for_the_lock(tmp_path):
    assert lock_caveat(tmp_path) is None, f"{tmp_path} is on a network file system here"
    mounts = [Part("/dev/sda1", "/", "ext4", "rw"), Part("nas:/export", str(tmp_path), "nfs4", "rw")]
    caveat = lock_caveat(tmp_path / "out", partitions=mounts)
    assert caveat and "nfs4" in caveat and "nas:/export" in caveat and "another machine" in caveat
    assert lock_caveat(tmp_path.parent, partitions=mounts) is None  # the longest mount point decides


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.soak
def test_two_builds_from_one_source_into_two_outs_at_once_share_nothing_mutable(tmp_path, tiny_model, source):
    """Run together, each with its own Prefect home: both finish with the same bytes; the source and the model
    are untouched; the only state they share is the file-hash memo, whose entries are whole (atomic replace of
    identical content)."""
    before_source, before_model = _tree(source), _tree(tiny_model)
    memo = tmp_path / "hash-memo"
    procs = []
    for name in ("a", "b"):
        home = tmp_path / f"home-{name}"
        home.mkdir()
        env = cli_env(home) | {"LATENTFORGE_CACHE_DIR": str(memo)}
        err = (tmp_path / f"{name}.err").open("w")
        procs.append((subprocess.Popen(_build(source, tiny_model, tmp_path / name), env=env, stderr=err), err))
    for proc, err in procs:
        assert proc.wait(timeout=600) == 0, (tmp_path / f"{Path(err.name).stem}.err").read_text()[-2000:]
        err.close()
    outs = [{k: v for k, v in _tree(tmp_path / n).items() if k.endswith(".pt")} for n in ("a", "b")]
    assert outs[0] and outs[0] == outs[1]
    fingerprints = {json.loads((tmp_path / n / "cache.json").read_text())["fingerprint"] for n in ("a", "b")}
    assert len(fingerprints) == 1
    assert _tree(source) == before_source and _tree(tiny_model) == before_model
    entries = list((memo / "file-hashes").rglob("*"))
    assert [e for e in entries if e.is_file()] and all(
        json.loads(e.read_text())["sha256"] for e in entries if e.is_file() and not e.name.startswith(".")
    )
