"""The Ray runner: a local Ray cluster (2 CPUs) builds through Prefect's RayTaskRunner the same bytes as the
local runner, loads the models once per worker process, survives a worker killed mid-shard, and is refused with
the extra's name when Ray is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from flows.terminal_run import run_build
from infra.cache import ledger
from infra.config import BuildConfig
from infra.faults import KILL_FILE_ENV
from infra.models import LOAD_LOG_ENV
from infra.ops import runners
from infra.plan import ShardPlan, make_plan
from infra.preprocess.chunks import PARTS_DIR, Chunk, merge, plan_chunks
from infra.preprocess.shard import process_shard
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.procs import cli_env

ray = pytest.importorskip("ray")

RAY_CPUS = 2
FRAMES, HEIGHT, WIDTH = 5, 32, 48  # the smallest Wan2.2 geometry with H ≠ W
SAMPLES_PER_SHARD = 3
CHUNK = 2  # a shard of 3 samples → chunks of 2 and 1
#: Row fields that say when and by which run a row was written, not what it holds.
VOLATILE = ("seconds",)


@pytest.fixture(scope="module")
def counters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-counters")


@pytest.fixture(scope="module")
def cluster(counters: Path) -> Iterator[None]:
    """One local Ray cluster of 2 CPUs for the file; its workers count their model loads and watch a kill file."""
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415 - the harness's API, set by then

    os.environ[LOAD_LOG_ENV] = str(counters)
    os.environ[KILL_FILE_ENV] = str(counters / "kill")
    env = runners.worker_env(PREFECT_API_URL.value())
    env["PYTHONPATH"] = runners.CODE_ROOT
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, namespace=runners.NAMESPACE, runtime_env={"env_vars": env})
    yield
    ray.shutdown()
    os.environ.pop(LOAD_LOG_ENV, None)
    os.environ.pop(KILL_FILE_ENV, None)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> Path:
    """Two shards of three real clips each."""
    videos = [cut_clip(clips[name], 8, width=96) for name in ("bikes", "carphone", "bigbuckbunny")]
    shards = {
        f"G-11_part-0000{s}": [sample(s, i, v, f"clip {i} of shard {s}".encode()) for i, v in enumerate(videos)]
        for s in (0, 1)
    }
    return make_shards(tmp_path_factory.mktemp("ray-src"), shards)


def _config(src: Path, model: Path, out: Path, **overrides: Any) -> BuildConfig:
    return config(src, model, out, frames=FRAMES, height=HEIGHT, width=WIDTH, **overrides)


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory, source: Path, tiny_model: Path) -> Path:
    """The reference: the same build on the local runner (threads)."""
    out = tmp_path_factory.mktemp("ray-local") / "out"
    ok, result = run_build(_config(source, tiny_model, out))
    assert ok, result
    assert result["done"] == 2 * SAMPLES_PER_SHARD
    return out


def _data(out: Path) -> dict[str, str]:
    """Hashes of every data file (ledgers and cache.json are compared apart: they hold times and run ids)."""
    return {k: v for k, v in tree_hashes(out).items() if not k.startswith("ledger/") and k != "cache.json"}


def _ledgers(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every sealed ledger, row by row in file order, without the fields that say when and by which run."""
    found = {}
    for path in sorted(ledger.ledger_dir(out).glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            for name in VOLATILE:
                row.pop(name)
            row["extra"].pop("run_id", None)
        found[path.name] = rows
    return found


def _cache_json(out: Path) -> dict[str, Any]:
    data = json.loads((out / "cache.json").read_text())
    data["provenance"].pop("created")
    return data


def _assert_same_cache(out: Path, reference: Path) -> None:
    assert _data(out) == _data(reference) and len(_data(out)) >= 2 * SAMPLES_PER_SHARD
    assert _ledgers(out) == _ledgers(reference)
    assert _cache_json(out) == _cache_json(reference)
    leftovers = [p for p in out.rglob("*") if p.name.endswith((".lftmp", ".journal.jsonl")) or p.name == PARTS_DIR]
    assert leftovers == []


def _loads(counters: Path) -> dict[int, int]:
    """Model loads per Ray worker process (the test process's own sanity loads left out)."""
    found = {int(p.stem): len(p.read_text().splitlines()) for p in counters.glob("*.loads")}
    found.pop(os.getpid(), None)
    return found


def _progress_percent() -> float:
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["build-progress"]))
        )
    latest = max(artifacts, key=lambda a: a.updated or a.created)
    return float(latest.data)


def _task_runs(state: str) -> list[Any]:
    """Every task run of this session's API in `state` (a StateType name)."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import (  # noqa: PLC0415
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415

    wanted = TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType[state]]))
    with get_client(sync_client=True) as client:
        return client.read_task_runs(task_run_filter=TaskRunFilter(state=wanted))


def test_ray_builds_the_local_runners_bytes_in_chunks_loading_models_once_per_worker(
    tmp_path, cluster, source, tiny_model, local_cache, counters
):
    out = tmp_path / "out"
    ok, result = run_build(_config(source, tiny_model, out, runner="ray", chunk_size=CHUNK, decode_samples=1))
    assert ok, result
    assert (result["done"], result["failed"], result["skipped"]) == (2 * SAMPLES_PER_SHARD, 0, 0)
    assert result["reconciled"] and result["decode_headline"] and result["sanity"]  # the gates ran as before
    _assert_same_cache(out, local_cache)
    assert _progress_percent() == 100.0  # counted in the workers, read by the flow
    loads = _loads(counters)
    tasks = 2 * len(range(0, SAMPLES_PER_SHARD, CHUNK))  # 4 chunk tasks
    assert loads and set(loads.values()) == {1}  # each worker process loaded the models once
    assert sum(loads.values()) < tasks  # and reused them for the tasks it ran after its first


def test_a_worker_killed_mid_shard_is_retried_and_the_cache_ends_identical(
    tmp_path, cluster, source, tiny_model, local_cache, counters
):
    kill = counters / "kill"
    kill.write_text("sample")  # the first worker to journal a sample is SIGKILLed there, once
    out = tmp_path / "out"
    ok, result = run_build(_config(source, tiny_model, out, runner="ray"))
    assert not kill.exists(), "no worker reached the kill point"
    (taken,) = counters.glob("kill.*")
    killed = int(taken.suffix[1:])
    assert killed != os.getpid() and not psutil.pid_exists(killed)
    assert ok, result
    assert (result["done"], result["failed"], result["skipped"]) == (2 * SAMPLES_PER_SHARD, 0, 0)
    assert result["encoded"] + result["reused"] == 2 * SAMPLES_PER_SHARD
    assert result["reused"] >= 1  # the killed task's journalled sample, kept by its resubmission
    # Not left Running: the lost task's run is marked Crashed, unless its worker was killed before its events
    # reached the server (then the server never recorded that run at all, and there is nothing to mark).
    assert not [run.name for run in _task_runs("RUNNING") if run.name.startswith("preprocess-shard")]
    assert [run.name.startswith("preprocess-shard") for run in _task_runs("CRASHED")] in ([True], [])
    _assert_same_cache(out, local_cache)


def test_runner_ray_without_the_extra_names_it(tmp_path, tiny_model, source):
    blocked = tmp_path / "no-ray"
    for name in ("ray", "prefect_ray"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('No module named {name}')\n")
    env = cli_env(tmp_path / "home")
    env["PYTHONPATH"] = os.pathsep.join((str(blocked), env["PYTHONPATH"]))
    out = tmp_path / "out"
    args = ["build", "--source", f"vbvr:{source}", "--model", str(tiny_model), "--out", str(out), "--runner", "ray"]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'latentforge[ray]'" in done.stderr
    assert not out.exists()


def test_resource_requests_follow_the_device(tmp_path):
    base = {"source": "vbvr:/x", "model": "/m", "out": str(tmp_path)}
    cpu = runners.remote_options(BuildConfig(**base, device="cpu"))
    assert cpu == {"num_cpus": 1, "max_retries": 0, "max_calls": 0}
    assert runners.remote_options(BuildConfig(**base, device="cuda"))["num_gpus"] == 1
    assert runners.remote_options(BuildConfig(**base, device="neuron"))["resources"] == {"neuron_cores": 1}


def test_workers_report_to_the_configured_api_else_to_the_flows_ephemeral_one(tmp_path):
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings  # noqa: PLC0415

    def reported() -> str | None:
        cfg = BuildConfig(source="vbvr:/x", model="/m", out=str(tmp_path))
        return runners.init_kwargs(cfg)["runtime_env"]["env_vars"].get("PREFECT_API_URL")

    harness = str(PREFECT_API_URL.value())  # the session's server, also Prefect's ephemeral one in this process
    assert reported() == harness
    with temporary_settings(restore_defaults={PREFECT_API_URL}, updates={PREFECT_SERVER_EPHEMERAL_ENABLED: True}):
        assert reported() == harness  # none configured: the server Prefect's own client talks to
    with temporary_settings(restore_defaults={PREFECT_API_URL}, updates={PREFECT_SERVER_EPHEMERAL_ENABLED: False}):
        assert reported() is None


def test_chunks_cover_the_shard_once_and_the_last_runs_to_the_quota():
    shard = ShardPlan(id="s", path="/s.tar", samples=5, quota=None)
    assert plan_chunks(shard, None) is None and plan_chunks(shard, 5) is None
    assert plan_chunks(shard, 2) == [
        Chunk(index=0, start=0, stop=2),
        Chunk(index=1, start=2, stop=4),
        Chunk(index=2, start=4, stop=None),
    ]
    capped = ShardPlan(id="s", path="/s.tar", samples=3, quota=3)
    assert plan_chunks(capped, 2)[-1] == Chunk(index=1, start=2, stop=3)
    assert Chunk(index=7, start=0, stop=1).ledger_id("s") == f"{PARTS_DIR}/s.chunk-00007"


def test_the_cluster_recipe_parses_and_asks_for_what_the_tasks_request():
    import yaml  # noqa: PLC0415

    recipe = Path(runners.CODE_ROOT) / "infra" / "deploy" / "ray"
    cluster = yaml.safe_load((recipe / "cluster.yaml").read_text())
    assert cluster["provider"]["type"] == "local"
    assert any("--num-gpus" in c for c in cluster["worker_start_ray_commands"])
    assert "neuron_cores" in (recipe / "README.md").read_text()


def test_chunks_of_a_shard_merge_into_the_unchunked_ledger_and_resume_from_their_parts(tmp_path, source, tiny_model):
    """Plain functions, no runner: the chunks' parts merged equal one task's ledger; a chunk run again keeps its
    samples (from the merged ledger), and a part left by an interrupted run is read back and merged."""
    whole, chunked = tmp_path / "whole", tmp_path / "chunked"
    for out in (whole, chunked):
        out.mkdir()
    plan = make_plan(_config(source, tiny_model, whole))
    shard = plan.shards[0]
    process_shard(plan.job, shard)
    plan = make_plan(_config(source, tiny_model, chunked, chunk_size=CHUNK))
    chunks = plan_chunks(shard, CHUNK)
    results = [process_shard(plan.job, shard, chunk=c) for c in chunks]
    assert (ledger.ledger_dir(chunked) / PARTS_DIR).is_dir() and not ledger.sealed_path(chunked, shard.id).exists()
    resumed = process_shard(plan.job, shard, chunk=chunks[0])  # its part, not yet merged, is what it resumes from
    assert (resumed.encoded, resumed.reused) == (0, CHUNK)
    merged = merge(chunked, shard.id, chunks, results)
    assert merged.counts == {"done": SAMPLES_PER_SHARD} and merged.encoded == SAMPLES_PER_SHARD
    assert _ledgers(chunked) == _ledgers(whole) and _data(chunked) == _data(whole)
    assert not (ledger.ledger_dir(chunked) / PARTS_DIR).exists()
    again = process_shard(plan.job, shard, chunk=chunks[1])  # resumes from the shard's ledger: nothing encoded
    assert (again.encoded, again.reused) == (0, len(range(chunks[1].start, SAMPLES_PER_SHARD)))
    assert merge(chunked, shard.id, chunks, [again]).counts == {"done": SAMPLES_PER_SHARD}
    assert _ledgers(chunked) == _ledgers(whole)


def test_runner_settings_stay_out_of_the_fingerprint(tmp_path, source, tiny_model):
    from infra.plan import make_spec  # noqa: PLC0415

    local = make_spec(_config(source, tiny_model, tmp_path))[1]
    ray_run = _config(source, tiny_model, tmp_path, runner="ray", ray_address="auto", chunk_size=7, workers=5)
    assert make_spec(ray_run)[1].fingerprint() == local.fingerprint()


def test_a_lost_worker_is_told_from_a_failed_task():
    assert runners.worker_lost(ray.exceptions.WorkerCrashedError())
    assert runners.worker_lost(ray.exceptions.NodeDiedError("node gone"))
    assert not runners.worker_lost(RuntimeError("the task itself failed"))


#: The issue's case: default settings at 33×128² (fp32), where a 1-thread encode differs from a 2-thread one.
DEFAULT_FRAMES, DEFAULT_SIZE = 33, 128


def test_ray_with_default_settings_writes_the_local_runners_x0_bytes(tmp_path, cluster, clips, tiny_model):
    """A Ray worker is given one CPU (Ray sets OMP_NUM_THREADS=1 there) and the local run has the machine's
    threads; both encode on `infra.devices.CPU_THREADS` intra-op threads, so every file is the same, bit for bit."""
    videos = [cut_clip(clips[name], 40, width=256) for name in ("bikes", "carphone", "bigbuckbunny")]
    shards = {
        f"G-11_part-0000{s}": [sample(s, i, v, f"clip {i}".encode()) for i, v in enumerate(videos)] for s in (0, 1)
    }
    src = make_shards(tmp_path / "src", shards)
    geometry = {"frames": DEFAULT_FRAMES, "height": DEFAULT_SIZE, "width": DEFAULT_SIZE}
    outs = {}
    for runner in ("local", "ray"):
        outs[runner] = tmp_path / runner
        ok, result = run_build(config(src, tiny_model, outs[runner], runner=runner, **geometry))
        assert ok and result["done"] == 2 * len(videos), result
    _assert_same_cache(outs["ray"], outs["local"])
