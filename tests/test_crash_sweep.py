"""The crash-resume sweep (`make soak`): a real `latentforge build` SIGKILLed at every kill point of
`infra.faults`, each chosen by progress (the N-th time the build reaches it, N read from an uninterrupted
reference run's log of points), then rerun: the final cache is byte-identical to the reference (every sample
file and every ledger fact), no temporary file is visible, the ledger agrees with the files, and no process of
the killed run is left (its ephemeral Prefect server is reaped by the rerun). About 6 minutes here, so it runs
only with LATENTFORGE_SOAK=1 (`make soak`); `tests/test_crash.py` keeps one kill point in `make test`."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from infra.cache import ledger
from infra.faults import ENV, LOG_ENV, POINTS
from infra.ops import ephemeral
from infra.storage import TEMP_SUFFIX
from tests.conftest import FRAMES, HEIGHT, WIDTH, make_shards, sample
from tests.media_utils import cut_clip
from tests.procs import cli_env

pytestmark = pytest.mark.soak
logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
#: Points that happen once per sample: killed at their hit after the first sample is journalled (mid-run).
PER_SAMPLE = ("decode", "encode", "write", "sample")


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips[name], 20, width=160) for name in ("bikes", "carphone", "bigbuckbunny")]
    samples = [sample(i % 2, i, videos[i % 3], f"clip {i} moves".encode()) for i in range(4)]
    return make_shards(tmp_path_factory.mktemp("sweep-src"), {"shard-a": samples[:2], "shard-b": samples[2:]})


def _build(src: Path, model: Path, out: Path, home: Path, extra_env: dict[str, str]) -> tuple[int, str]:
    """Run a build to its end (or its kill): (returncode, stderr). Output goes to files, not pipes: a killed
    build's orphaned Prefect server would hold a pipe open until the next run reaps it."""
    cmd = [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(model),
        "--out", str(out), "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "2", "--on-loss", "abort",
    ]  # fmt: skip
    env = {k: v for k, v in cli_env(home).items() if k not in (ENV, LOG_ENV)}
    err = out.with_name(out.name + ".stderr")
    with err.open("w") as stderr:
        code = subprocess.run(cmd, env=env | extra_env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=600, cwd=home)
    return code.returncode, err.read_text(errors="replace")


def _facts(out: Path) -> tuple[dict[str, str], dict[str, tuple]]:
    files = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.pt"))}
    rows = {
        f"{shard}/{key}": (row.status, row.reason, row.path, row.bytes, row.sha256)
        for shard, rows in ledger.read_all(out).items()
        for key, row in rows.items()
    }
    return files, rows


def _nth(log: list[str], point: str) -> int:
    """Which hit of `point` to kill at: for per-sample points the first after a sample is journalled."""
    if point not in PER_SAMPLE:
        return 1
    first_sample = log.index("sample")
    return log[: first_sample + 1].count(point) + 1


@pytest.mark.timeout(3600)
def test_every_kill_point_resumes_to_the_same_bytes(source, tiny_model, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    reference_log = tmp_path / "points.log"
    code, err = _build(source, tiny_model, tmp_path / "ref", home, {LOG_ENV: str(reference_log)})
    assert code == 0, err[-3000:]
    log = reference_log.read_text().split()
    assert set(POINTS) <= set(log), f"points never reached by the reference run: {set(POINTS) - set(log)}"
    reference = _facts(tmp_path / "ref")
    survived = []
    for point in POINTS:
        nth = _nth(log, point)
        out = tmp_path / f"out-{point}"
        started = time.monotonic()
        code, err = _build(source, tiny_model, out, home, {ENV: f"{point}:{nth}"})
        assert code == -9, f"{point}:{nth} not killed there: {code} {err[-2000:]}"
        orphans = [r.server_pid for _, r in ephemeral.read_records(home) if r is not None]
        code, err = _build(source, tiny_model, out, home, {})
        assert code == 0, f"after {point}:{nth}: {err[-3000:]}"
        assert _facts(out) == reference, f"after a kill at {point}:{nth} the cache differs from the reference"
        assert not [p for p in out.rglob(f"*{TEMP_SUFFIX}")], f"temporary files visible after {point}"
        for row in (r for rows in ledger.read_all(out).values() for r in rows.values() if r.status == "done"):
            assert all((out / f.path).stat().st_size == f.bytes for f in row.output_files()), (point, row.key)
        assert ephemeral.read_records(home) == [], f"a server record outlived the runs after {point}"
        left = [pid for pid in orphans if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert not left, f"the killed run's Prefect server outlived the rerun after {point}: {left}"
        survived.append((point, nth, round(time.monotonic() - started, 1)))
    lines = "\n".join(f"  {p:<8} hit {n:<2} killed + rerun {s:>6.1f} s" for p, n, s in survived)
    print(f"\ncrash-resume sweep: {len(survived)} kill points survived, bytes lost 0\n{lines}")
