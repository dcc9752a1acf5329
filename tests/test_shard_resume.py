"""A crash inside a shard part, for real: a writer SIGKILLed at the ``part`` kill point (a sample appended to the
open part, the part not yet linked) leaves no truncated shard file visible, and the next writer of that source
shard continues at the same part number to the same bytes. In `make soak`: a whole `latentforge build` of the
webdataset format SIGKILLed there, rerun, ends byte-identical to an uninterrupted build."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from flows.terminal_run import run_build
from infra.faults import ENV, LOG_ENV
from infra.storage import TEMP_SUFFIX
from tests import shard_child
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]
PER_PART = shard_child.PER_PART


def _killed_write(out: Path, fmt: str, home: Path) -> int:
    """A child writing samples 0..4, SIGKILLed at its third sample (the first of part 1, still open)."""
    cmd = [sys.executable, "-m", "tests.shard_child", str(out), "0", "5", fmt]
    env = cli_env(home, **{ENV: "part:3"})
    return subprocess.run(cmd, env=env, cwd=ROOT, timeout=300, capture_output=True).returncode


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_a_writer_killed_mid_part_leaves_only_whole_parts_and_resumes_to_the_same_bytes(tmp_path, fmt):
    reference, out = tmp_path / "reference", tmp_path / "out"
    shard_child.write(reference, 0, 5, fmt)
    assert _killed_write(out, fmt, tmp_path) == -signal.SIGKILL
    visible = sorted(p.name for p in (out / "shards").iterdir() if not p.name.startswith("."))
    hidden = [p.name for p in (out / "shards").iterdir() if p.name.startswith(".")]
    suffix = ".tar" if fmt == "webdataset" else ".parquet"
    assert visible == [f"s-00000{suffix}"] and len(hidden) == 1 and hidden[0].endswith(TEMP_SUFFIX)
    assert _hashes(out / "shards")[visible[0]] == _hashes(reference / "shards")[visible[0]]  # whole, as it should be
    if fmt == "webdataset":
        with tarfile.open(out / "shards" / visible[0]) as tar:
            assert len(tar.getmembers()) == 2 * 4
    (out / "shards" / hidden[0]).unlink()  # what a build's start does with its stale temps (under the OUT lock)
    shard_child.write(out, 2, 5, fmt)  # the rows of the lost part, encoded again
    assert _hashes(out / "shards") == _hashes(reference / "shards")
    assert _hashes(out / "ledger/parts") == _hashes(reference / "ledger/parts")


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_parts_rotate_by_size_as_well_as_by_count(tmp_path, fmt):
    class BySize:  # any sample reaches the limit: one sample per part, then the next part
        shard_samples, shard_bytes, parquet_dtype = 1000, 1, None

    shard_child.write(tmp_path, 0, 3, fmt, BySize)
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "ledger/parts").iterdir())]
    assert [(r["path"], r["samples"], r["members"]) for r in records] == [
        (f"shards/s-{i:05d}{'.tar' if fmt == 'webdataset' else '.parquet'}", 1, [f"g/s{i}"]) for i in range(3)
    ]
    for record in records:
        assert record["sha256"] == hashlib.sha256((tmp_path / record["path"]).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips[name], 10, width=160) for name in ("bikes", "carphone", "bigbuckbunny")]
    samples = [sample(i % 2, i, videos[i % 3], f"clip {i} moves".encode()) for i in range(6)]
    return make_shards(tmp_path_factory.mktemp("shard-kill-src"), {"shard-a": samples[:3], "shard-b": samples[3:]})


def _cli(src: Path, model: Path, out: Path, home: Path, extra: dict[str, str]) -> tuple[int, str]:
    """Run a build to its end (or its kill): (returncode, stderr). Output goes to files, not pipes: a killed
    build's orphaned Prefect server would hold a pipe open until the rerun reaps it."""
    cmd = [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(model),
        "--out", str(out), "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0", "--on-loss", "abort",
        "--format", "webdataset", "--shard-samples", str(PER_PART),
    ]  # fmt: skip
    env = {k: v for k, v in cli_env(home).items() if k not in (ENV, LOG_ENV)} | extra
    err = out.with_name(out.name + ".stderr")
    with err.open("w") as stderr:
        code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=600, cwd=home)
    return code.returncode, err.read_text(errors="replace")


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_a_build_killed_mid_part_reruns_to_the_bytes_of_an_uninterrupted_build(source, tiny_model, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    # Hits of `part`: the sanity sample (beside OUT), shard-a's samples 0 and 1 (part 0, then linked), sample 2:
    # killed there, with part 0 finished and part 1 open.
    code, err = _cli(source, tiny_model, out, home, {ENV: f"part:{1 + PER_PART + 1}"})
    assert code == -signal.SIGKILL, err[-3000:]
    visible = sorted(p.name for p in (out / "shards").iterdir() if not p.name.startswith("."))
    assert visible == ["shard-a-00000.tar"], visible  # no truncated tar under a final name
    with tarfile.open(out / "shards" / visible[0]) as tar:
        assert len(tar.getmembers()) == PER_PART * 4
    code, err = _cli(source, tiny_model, out, home, {})
    assert code == 0, err[-3000:]
    reference = tmp_path / "reference"
    ok, result = run_build(config(source, tiny_model, reference, workers=1, format="webdataset", shard_samples=2))
    assert ok, result
    keep = ("shards/", "ledger/parts/", "_meta.json")
    wanted = {k: v for k, v in tree_hashes(reference).items() if k.startswith(keep)}
    assert len(wanted) == 2 * 2 * 2 + 1 and wanted == {k: v for k, v in tree_hashes(out).items() if k.startswith(keep)}
    assert not list(out.rglob(f"*{TEMP_SUFFIX}"))
