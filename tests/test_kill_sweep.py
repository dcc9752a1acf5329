"""The short kill sweep (`make test`; the full one, every kill point, is `make soak`'s `tests/test_crash_sweep.py`): a
real `latentforge build` SIGKILLed three times in a row at points chosen at random by progress (the N-th time a run
reaches a point, N drawn from the samples it has left), samples in flight at the kills, then ONE plain run of the same
command: exit 0, every sample done, and the bytes of an uninterrupted build (every sample file and ledger fact).

A kill from outside (a spot instance gone, an operator, the OOM killer acting for another process) blames no sample
(`infra.preprocess.inflight`): the samples in flight at each kill are suspects, decoded alone in a child by the next
run, and none ends ``failed`` / ``killed_run``. The seed and the points are printed (and in every failure's message);
``LATENTFORGE_KILL_SEED=N`` replays a sweep. The killed builds use the session's Prefect API (``PREFECT_API_URL``), not
an embedded server of their own: ~10 s less a build, and the killed builds' servers are the soak's to reap."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.faults import ENV, LOG_ENV
from infra.preprocess.alone import SUSPECT_POINT
from infra.storage import TEMP_SUFFIX
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.procs import cli_env

SHARD = "s"
SAMPLES = 5
KILLS = 3
#: Per-sample points of the shard loop: ``decode`` and ``encode`` (the sample in flight, the read-ahead ones too) are
#: also reached once by the sanity, when it has a sample to try; ``sample`` (its row journalled) only by the shard.
IN_FLIGHT = ("decode", "encode")
POINTS = (*IN_FLIGHT, "sample")


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips[name], 9, width=96) for name in ("bikes", "carphone", "bigbuckbunny")]
    samples = [sample(i % 2, i, videos[i % 3], f"clip {i} moves".encode()) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("kill-sweep-src"), {SHARD: samples})


def _command(src: Path, model: Path, out: Path) -> list[str]:
    return [
        "build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--frames", str(FRAMES),
        "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu", "--dtype", "fp32", "--workers", "1",
        "--decode-samples", "0", "--on-loss", "abort",
    ]  # fmt: skip


def _facts(out: Path) -> tuple[dict[str, str], dict[str, tuple]]:
    files = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.pt"))}
    rows = {k: (r.status, r.reason, r.path, r.bytes, r.sha256) for k, r in ledger.read_shard(out, SHARD).items()}
    return files, rows


def _state(out: Path) -> tuple[int, set[str]]:
    """(samples done, samples in flight: their marks with no row after them)."""
    marks: ledger.Marks = {}
    rows = ledger.read_shard(out, SHARD, marks) if (out / "ledger").exists() else {}
    return sum(r.status == "done" for r in rows.values()), set(marks)


def _kill_point(rng: random.Random, done: int, in_flight: set[str]) -> str:
    """A point where the next run is SIGKILLed, by progress: the k-th of the samples it has left (k at most 2, so
    every kill finds one left), its decode or encode (the sanity's first where it has a sample to try: one not in
    flight before), or its row journalled."""
    left = SAMPLES - done
    k = rng.randint(1, min(2, left))
    point = rng.choice(POINTS)
    sanity = point in IN_FLIGHT and left > len(in_flight)
    return f"{point}:{k + sanity}"


@pytest.mark.slow
def test_a_build_killed_three_times_then_run_once_more_is_the_uninterrupted_cache(tmp_path, tiny_model, source):
    seed = int(os.environ.get("LATENTFORGE_KILL_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    started = time.monotonic()
    reference = tmp_path / "reference"
    ok, result = run_build(config(source, tiny_model, reference, workers=1))
    assert ok and result["done"] == SAMPLES, result
    out, home, command = tmp_path / "out", tmp_path / "home", _command(source, tiny_model, tmp_path / "out")
    env = {k: v for k, v in cli_env(home).items() if k not in (ENV, LOG_ENV)}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())  # the session's API: no embedded server to start
    kills: list[str] = []
    in_flight_at_kills = 0
    for n in range(KILLS):
        point = _kill_point(rng, *_state(out))
        kills.append(point)
        where = f"seed {seed}, kills {kills}"
        err = tmp_path / f"kill-{n}.err"
        with err.open("wb") as stderr:
            code = subprocess.run(
                [sys.executable, "-m", "flows.cli", *command], env=env | {ENV: point}, cwd=tmp_path,
                stdout=subprocess.DEVNULL, stderr=stderr, timeout=300, check=False,
            ).returncode  # fmt: skip
        assert code == -9, f"{where}: not killed at {point} (exit {code}): {err.read_text(errors='replace')[-3000:]}"
        done, in_flight = _state(out)
        in_flight_at_kills += bool(in_flight)
        print(f"kill {n + 1} at {point}: {done} done, in flight {sorted(in_flight)}")
    assert in_flight_at_kills >= 2, f"seed {seed}, kills {kills}: samples were in flight at {in_flight_at_kills} kills"

    points = tmp_path / "points.log"
    os.environ[LOG_ENV] = str(points)  # this process's points, and its children's: which samples were decoded alone
    try:
        rerun = CliRunner().invoke(app, command)  # the same command, once, in this process (saves a start)
    finally:
        del os.environ[LOG_ENV]
    where = f"seed {seed}, kills {kills}"
    assert rerun.exit_code == 0, f"{where}: {rerun.output[-3000:]}"
    files, rows = _facts(out)
    assert {r[0] for r in rows.values()} == {"done"} and len(rows) == SAMPLES, f"{where}: {rows}"
    assert (files, rows) == _facts(reference), f"{where}: the cache differs from the uninterrupted build's"
    assert not list(out.rglob(f"*{TEMP_SUFFIX}")), f"{where}: temporary files are left"
    suspects = points.read_text().split().count(SUSPECT_POINT) if points.exists() else 0
    print(
        f"kill sweep, seed {seed}: SIGKILLed at {', '.join(kills)}, then one rerun: {SAMPLES} of {SAMPLES} done, "
        f"{suspects} decoded alone in a child by the rerun, bytes lost 0, {time.monotonic() - started:.0f} s"
    )
