"""OUT in an object store, when a run dies or loses its lease: a build SIGKILLed mid-shard resumes to the bytes of an
uninterrupted build (re-encoding at most what was not recorded; the sample in flight seen in progress; the dead run's
lease taken over when it runs out); a sample that kills the build twice is recorded failed (`make soak`); a run whose
lease is taken over puts nothing more; cache.json is the last object a run writes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prefect.settings import PREFECT_API_URL

from flows.terminal_run import run_build
from infra import outstore
from infra.cache import ledger
from infra.cache.cachedir import CACHE_JSON, PENDING_JSON
from infra.cache.lock import LEASE_ENV, LOCK_NAME, LockedError, check_not_locked
from infra.faults import ENV, HOLD_ENV, KILL_ON_ENV, LOG_ENV
from infra.outstore import StoreOut
from infra.preprocess.alone import SUSPECT_POINT
from infra.preprocess.inflight import KILLED_RUN, PROOF
from tests.conftest import FRAMES, HEIGHT, WIDTH, assert_same_cache, config, make_shards, sample, tree_files
from tests.media_utils import cut_clip
from tests.procs import cli_env
from tests.s3_proxy import LoopbackS3, module_s3

ACCESS_KEY, SECRET_KEY = "AKIDSTORECRASHTEST", "store-crash-secret-never-written"
BUCKET = "lf-crash"
SAMPLES = 4  # shard a: 2, shard b: 2
#: The killed child's lease (seconds; its heartbeat a quarter of it): long enough to be seen live right after the kill.
CHILD_LEASE_S = "6"


s3 = module_s3(BUCKET, ACCESS_KEY, SECRET_KEY)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> Path:
    video = cut_clip(clips["carphone"], 6, width=96)
    samples = [sample(i % 2, i, video, b"clip %d moves" % i) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("crash-src"), {"a": samples[:2], "b": samples[2:]})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, source: Path, tiny_model: Path) -> dict[str, bytes]:
    """The files of an uninterrupted local build of the source."""
    out = tmp_path_factory.mktemp("reference") / "out"
    ok, result = run_build(config(source, tiny_model, out, workers=1))
    assert ok and result["done"] == SAMPLES, result
    return tree_files(out)


def _cli(source: Path, model: Path, url: str) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{source}", "--model", str(model), "--out", url,
        "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu", "--dtype", "fp32",
        "--workers", "1", "--decode-samples", "0", "--on-loss", "accept",
    ]  # fmt: skip


def _killed(cmd: list[str], logs: Path, name: str, **env: str) -> None:
    """Run the CLI build, which a kill point ends with SIGKILL: the loopback store's AWS chain is this process's, the
    Prefect API the test harness's (no embedded server to start)."""
    env = cli_env(logs / "home", PREFECT_API_URL=str(PREFECT_API_URL.value()), **env)
    with (logs / f"{name}.err").open("wb") as stderr:
        proc = subprocess.run(cmd, env=env, cwd=logs, stdout=subprocess.DEVNULL, stderr=stderr, timeout=300)
    text = (logs / f"{name}.err").read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"{name}: exit {proc.returncode}, not the kill:\n{text[-3000:]}"


def _in_progress(out: StoreOut, shard: str) -> dict[str, int]:
    """Sample key → how many runs died with it in progress (its marks with no row after them)."""
    marks: ledger.Marks = {}
    ledger.read_shard(out, shard, marks)
    return {key: len(found) for key, found in marks.items()}


def _without(files: dict[str, bytes], rels: list[str]) -> dict[str, bytes]:
    return {rel: data for rel, data in files.items() if rel not in rels}


def _facts(sealed: bytes) -> dict[str, tuple]:
    """What a sealed ledger says of each sample: its status, reason and file."""
    rows = [ledger.LedgerRow.model_validate_json(line) for line in sealed.decode().splitlines()]
    return {row.key: (row.status, row.reason, row.path, row.bytes, row.sha256) for row in rows}


def _puts(s3: LoopbackS3, prefix: str) -> list[str]:
    """The OUT-relative keys the proxy saw PUT below `prefix`, in order."""
    start = f"/{BUCKET}/{prefix}/"
    return [path.split("?")[0][len(start) :] for kind, path in s3.proxy.requests if kind == "PUT" and start in path]


def test_a_build_killed_mid_shard_resumes_on_s3_to_the_bytes_of_an_uninterrupted_one(
    s3, source, tiny_model, reference, tmp_path, monkeypatch
):
    url = f"s3://{BUCKET}/killed"
    out = StoreOut.of(url)
    # killed at shard b's first row (journalled in memory, not put yet): shard a sealed, b's journal parts its marks
    _killed(_cli(source, tiny_model, url), tmp_path, "killed", **{ENV: "sample:3", LEASE_ENV: CHILD_LEASE_S})
    # The dead run's lease: on this host its process is gone, so it is taken over at once; on another host it holds
    # until it runs out (CHILD_LEASE_S after its last heartbeat), then is taken over.
    check_not_locked(out)
    monkeypatch.setattr(socket, "gethostname", lambda: "another-node")
    with pytest.raises(LockedError, match="being written by another run"):
        check_not_locked(out)
    expires = datetime.fromisoformat(json.loads(out.read_bytes(LOCK_NAME))["expires"])
    left = s3.objects(BUCKET, "killed")
    assert "ledger/b.jsonl" not in left and any(rel.startswith("ledger/b.journal/") for rel in left), sorted(left)
    assert CACHE_JSON not in left and PENDING_JSON in left, sorted(left)  # cache.json is written last
    recorded = [row for rows in ledger.read_all(out).values() for row in rows.values() if row.status == "done"]
    assert recorded, "no row was put before the kill"
    # the sample in flight when the run died is seen in progress: its mark was put before its bytes were read
    in_progress = _in_progress(out, "b")
    assert in_progress and set(in_progress.values()) == {1}, in_progress
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 1.1)  # its expiry is to the second

    s3.proxy.reset()
    ok, result = run_build(config(source, tiny_model, url, workers=1))  # type: ignore[arg-type]  # on another-node
    assert ok, result
    assert result["encoded"] <= SAMPLES - len(recorded), result  # at most the samples not recorded, encoded again
    # every object as the uninterrupted build's (a row of an adopted file notes it: its facts are the same)
    resumed = s3.objects(BUCKET, "killed")
    ledgers = [rel for rel in reference if rel.startswith("ledger/") and rel.count("/") == 1 and rel.endswith(".jsonl")]
    assert_same_cache({k: v for k, v in resumed.items() if k not in ledgers}, _without(reference, ledgers))
    assert {rel: _facts(resumed[rel]) for rel in ledgers} == {rel: _facts(reference[rel]) for rel in ledgers}
    puts = [rel for rel in _puts(s3, "killed") if rel != LOCK_NAME and not rel.startswith("reports/")]
    assert puts[-1] == CACHE_JSON and puts.count(CACHE_JSON) == 1, puts


@pytest.mark.soak  # two killed builds and a third (~45 s here), as its local twin in tests/test_accounting.py
def test_samples_in_flight_at_two_kills_on_s3_are_not_blamed_and_one_that_kills_its_child_is_failed_on_proof(
    s3, source, tiny_model, tmp_path, monkeypatch
):
    url = f"s3://{BUCKET}/killer"
    out = StoreOut.of(url)
    cmd = _cli(source, tiny_model, url)
    # 1. killed from outside mid-decode of a's second sample (the sanity's decode, a's first, then it): its mark was put
    _killed(cmd, tmp_path, "first", **{ENV: "decode:3"})
    first = _in_progress(out, "a")
    assert first and set(first.values()) == {1}, first
    # 2. the rerun decodes each of them alone, in a child; it is killed from outside once the first is back (the
    # sanity's decode of b's first, then it)
    _killed(cmd, tmp_path, "second", **{ENV: "decode:2"})
    twice = sorted(key for key, deaths in _in_progress(out, "a").items() if deaths == 2)
    assert twice, _in_progress(out, "a")
    # 3. two kills from outside blame nobody; a sample whose every child dies is failed, its signal the proof
    monkeypatch.setenv(KILL_ON_ENV, f"{SUSPECT_POINT}={twice[0]}")
    ok, result = run_build(config(source, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    rows = ledger.read_shard(out, "a")
    killed = rows[twice[0]]
    assert (killed.status, killed.reason, killed.extra[PROOF]["signal"]) == ("failed", KILLED_RUN, "SIGKILL"), killed
    assert all(row.status == "done" for key, row in rows.items() if key != twice[0]), rows
    assert result["done"] == SAMPLES - 1, result


def test_a_run_whose_lease_is_taken_over_puts_nothing_more_and_stops_with_one_line(
    s3, source, tiny_model, tmp_path, monkeypatch
):
    url = f"s3://{BUCKET}/taken"
    out = StoreOut.of(url)
    hold, points = tmp_path / "hold", tmp_path / "points.log"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, f"sample:1={hold}")  # the build waits after its first row
    monkeypatch.setenv(LOG_ENV, str(points))
    monkeypatch.setenv(LEASE_ENV, "2")  # a heartbeat every 0.5 s
    ended: dict[str, Any] = {}
    build = threading.Thread(
        target=lambda: ended.update(result=run_build(config(source, tiny_model, url, workers=1))),  # type: ignore[arg-type]
        daemon=True,
    )
    build.start()
    try:
        _wait(lambda: points.exists() and "sample" in points.read_text().split(), "the build's first row")
        # another run takes the lease over, as a takeover does: If-Match on the ETag it read
        now = datetime.now(UTC)  # a live lease as another run writes one (a record that does not read back is a hold)
        theirs = {"pid": 1, "host": "the-other-run", "create_time": None, "since": now.isoformat()}
        theirs["expires"] = (now + timedelta(minutes=30)).isoformat()
        head = out.head(LOCK_NAME)
        assert head is not None
        out.put(LOCK_NAME, json.dumps(theirs).encode(), match=head.etag)
        _wait(lambda: url in outstore._lost, "the build to find its lease taken", timeout=30)
        s3.proxy.reset()
    finally:
        hold.unlink()
        build.join(timeout=120)
    assert not build.is_alive()
    ok, message = ended["result"]
    assert not ok and "lease was taken over by pid 1 on the-other-run" in str(message), message
    writes = [(kind, path) for kind, path in s3.proxy.requests if kind in ("PUT", "POST", "DELETE")]
    assert writes == [], writes  # nothing put, nothing deleted after it knew
    assert json.loads(out.read_bytes(LOCK_NAME)) == theirs  # the other run's lease is left as it is
    assert url not in outstore._lost  # the run ended: this process may write there again


def _wait(ready, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
