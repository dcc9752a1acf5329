"""Ray workers that share no disk: a local cluster (`tests/ray_nodes.py`: a head and two worker nodes, each with its own
HOME, TMPDIR, caches and Prefect home) builds from a source to an OUT both on a loopback S3 (moto's server on
127.0.0.1) with the model on the loopback Hub (`tests/fakehub.py`): the objects equal the local runner's build of the
same clips, each worker node fetched the model into its own cache once, and nothing outside a node's own folders
gained a file while the Ray build ran (the driver's folders, the checkout, the test's folders); no node's file (Ray's
logs included) holds the test's token or secret key. A run whose lease is taken over mid-build stops every process's
writes below OUT, the workers' as the driver's."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from flows.terminal_run import run_build
from infra import outstore
from infra.cache.lock import LEASE_ENV, LOCK_NAME
from infra.faults import HOLD_ENV
from infra.ops import runners
from infra.outstore import StoreOut
from tests import fakehub, ray_nodes
from tests.conftest import assert_same_cache, config, make_shards, sample, tree_files
from tests.media_utils import cut_clip
from tests.s3_proxy import loopback_s3

ray = pytest.importorskip("ray")

ACCESS_KEY, SECRET_KEY = "AKIDRAYNOSHARETEST", "ray-noshare-secret-never-written"
BUCKET = "lf-noshare"
MODEL_REPO = "org/tiny-wan22"
TOKEN = "hf_noshare_test_token"
FRAMES, HEIGHT, WIDTH = 5, 32, 48
SAMPLES_PER_SHARD, SHARDS = 3, 2
WORKER_NODES = 2
#: The model weight every machine fetches once (the driver for the plan, each worker node for its tasks).
VAE_WEIGHT = "vae/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    """moto's S3 server (behind the tests' proxy) and the fake Hub on 127.0.0.1 (the model in ``org/tiny-wan22``);
    yields the environment that reaches both, which this process and every node get, with the two servers."""
    hub = fakehub.FakeHub()
    hub.start()
    hub_env = {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    files = {p.relative_to(tiny_model).as_posix(): p.read_bytes() for p in tiny_model.rglob("*") if p.is_file()}
    hub.create(MODEL_REPO, private=True)
    hub.commit(MODEL_REPO, files)
    with (
        loopback_s3(BUCKET, ACCESS_KEY, SECRET_KEY, tmp_path_factory.mktemp("aws")) as s3,
        pytest.MonkeyPatch.context() as patch,
    ):
        import huggingface_hub.constants as hf_constants  # noqa: PLC0415 - read at import: patched for this process

        for name, value in hub_env.items():
            patch.setenv(name, value)
        patch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        try:
            yield s3.env | hub_env | {"hub": hub, "s3": s3}
        finally:
            hub.stop()


@pytest.fixture(scope="module")
def source(stores: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> str:
    """Two VBVR shards of three real clips each, uploaded to ``s3://BUCKET/src``; the source's spec."""
    videos = [cut_clip(clips[name], 8, width=96) for name in ("bikes", "carphone", "bigbuckbunny")]
    shards = {
        f"G-11_part-0000{s}": [sample(s, i, v, f"clip {i} of shard {s}".encode()) for i, v in enumerate(videos)]
        for s in range(SHARDS)
    }
    local = make_shards(tmp_path_factory.mktemp("noshare-src"), shards)
    for tar in sorted(local.glob("*.tar")):
        boto3.client("s3").put_object(Bucket=BUCKET, Key=f"src/{tar.name}", Body=tar.read_bytes())
    return f"vbvr:s3://{BUCKET}/src"


@pytest.fixture(scope="module")
def driver(stores: dict[str, Any]) -> Iterator[Path]:
    """The driver's (this process's) own HOME, TMPDIR and caches for the module, in a folder no node is given."""
    root = Path(tempfile.mkdtemp(prefix="lf-driver-", dir=ray_nodes.SHORT_TMP))
    with pytest.MonkeyPatch.context() as patch:
        for name, sub in ray_nodes.OWN_DIRS.items():
            if name == "PREFECT_HOME":
                continue  # this process's Prefect settings are loaded already: its home is watched where it is
            (root / sub).mkdir()
            patch.setenv(name, str(root / sub))
        patch.setattr(tempfile, "tempdir", str(root / "tmp"))  # tempfile's documented override of TMPDIR's cache
        yield root


@pytest.fixture(scope="module")
def cluster(stores: dict[str, Any], driver: Path) -> Iterator[ray_nodes.Cluster]:
    node_env = {k: v for k, v in stores.items() if isinstance(v, str)}
    node_env["PYTHONDONTWRITEBYTECODE"] = "1"  # the checkout stands for each host's own installation
    yield from ray_nodes.running(WORKER_NODES, node_env)


def _config(source: str, out: str, **overrides: Any) -> Any:
    return config(Path("-"), f"hf://{MODEL_REPO}", out, source=source, frames=FRAMES, height=HEIGHT,  # type: ignore[arg-type]
                  width=WIDTH, **overrides)  # fmt: skip


def _snapshot(roots: list[Path], skip: list[Path]) -> dict[str, tuple[int, int]]:
    """Every file under `roots` (not under `skip`): path → (size, mtime_ns)."""
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = [d for d in dirnames if here / d not in skip and d not in (".git", "__pycache__")]
            for name in filenames:
                path = here / name
                try:
                    stat = path.lstat()
                except FileNotFoundError:
                    continue
                found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


def _watched(driver: Path, cluster: ray_nodes.Cluster, tmp_root: Path) -> tuple[list[Path], list[Path]]:
    """(what no worker may write in, what is left out of it): the driver's folders and Prefect home, the checkout,
    the test session's folders; the head node's own folders (no task runs there) but its Ray folder."""
    from prefect.settings import PREFECT_HOME  # noqa: PLC0415

    head = cluster.nodes[0]
    roots = [driver, Path(PREFECT_HOME.value()), Path(runners.CODE_ROOT), tmp_root, *head.dirs.values()]
    return roots, [head.root / ray_nodes.RAY_DIR]


def _fetches(hub: fakehub.FakeHub) -> int:
    return sum(1 for r in hub.requests if r.method == "GET" and r.path.endswith(VAE_WEIGHT) and r.status == 200)


def test_ray_nodes_that_share_no_disk_build_the_local_runners_bytes(
    stores, source, driver, cluster, tmp_path, tmp_path_factory
):
    hub = stores["hub"]
    local = tmp_path / "local"
    ok, result = run_build(_config(source, str(local)))  # the driver's own fetch of the model, and the reference
    assert ok and result["done"] == SHARDS * SAMPLES_PER_SHARD, result
    assert _fetches(hub) == 1
    out = f"s3://{BUCKET}/ray"  # source, model and OUT all by URL: nothing of the cache on any disk
    roots, skip = _watched(driver, cluster, tmp_path_factory.getbasetemp())
    machine_cache = driver / ray_nodes.OWN_DIRS["LATENTFORGE_CACHE_DIR"]
    skip += [machine_cache / "sanity", machine_cache / "listings"]  # the driver's sanity sample, its plan's listings
    before = _snapshot(roots, skip)
    ok, result = run_build(_config(source, out, runner="ray", ray_address=cluster.address))
    assert ok and result["done"] == SHARDS * SAMPLES_PER_SHARD, result
    after = _snapshot(roots, skip)
    assert {p: v for p, v in after.items() if before.get(p) != v} == {}
    ours = stores["s3"].objects(BUCKET, "ray")
    assert_same_cache(ours, tree_files(local))  # every shard sealed (no journal part left), the same bytes
    assert len([k for k in ours if k.endswith(".pt")]) == SHARDS * SAMPLES_PER_SHARD
    for node in cluster.workers:  # each worker node fetched the model into its own Hub cache
        hub_cache = node.dirs["HF_HOME"] / "hub" / f"models--{MODEL_REPO.replace('/', '--')}"
        assert (hub_cache / "snapshots").is_dir(), node.name
    assert _fetches(hub) == 1 + WORKER_NODES  # once per machine
    leaked = [
        str(p)
        for node in cluster.nodes
        for p in node.root.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and any(s in p.read_bytes() for s in (TOKEN.encode(), SECRET_KEY.encode()))
    ]
    assert leaked == []


def _writes(s3: Any, prefix: str) -> list[tuple[str, str]]:
    return [(kind, path) for kind, path in s3.proxy.requests if kind in ("PUT", "POST", "DELETE") and prefix in path]


def _wait(ready: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_lease_taken_over_mid_build_stops_the_workers_writes_too(stores, source, cluster, tmp_path, monkeypatch):
    s3, url = stores["s3"], f"s3://{BUCKET}/ray-lease"
    out, prefix = StoreOut.of(url), f"/{BUCKET}/ray-lease/"
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, f"sample:1={hold}")  # each worker waits after its first row (passed to the workers)
    monkeypatch.setenv(LEASE_ENV, "2")  # the driver's heartbeat every 0.5 s
    ended: dict[str, Any] = {}
    build = threading.Thread(
        target=lambda: ended.update(result=run_build(_config(source, url, runner="ray", ray_address=cluster.address))),
        daemon=True,
    )
    build.start()
    try:  # both workers wrote their first sample and wait: their writes settle
        _wait(lambda: len({p.split("?")[0] for k, p in _writes(s3, prefix) if p.split("?")[0].endswith(".pt")}) >= 2,
              "a sample of each shard written", timeout=240)  # fmt: skip
        settled = -1  # the driver's heartbeat puts the lease meanwhile: the samples' writes are what settles
        while settled != len([w for w in _writes(s3, prefix) if LOCK_NAME not in w[1]]):
            settled = len([w for w in _writes(s3, prefix) if LOCK_NAME not in w[1]])
            time.sleep(1.5)
        # another run takes the lease over, as a takeover does: If-Match on the ETag it read
        theirs = {"pid": 1, "host": "the-other-run", "create_time": None, "since": "now", "expires": "2999-01-01"}
        head = out.head(LOCK_NAME)
        assert head is not None
        out.put(LOCK_NAME, json.dumps(theirs).encode(), match=head.etag)
        _wait(lambda: url in outstore._lost, "the driver to find its lease taken", timeout=30)
        s3.proxy.reset()  # the workers still wait: whatever any process writes from here is after the takeover
    finally:
        hold.unlink()
        build.join(timeout=240)
    assert not build.is_alive()
    ok, message = ended["result"]
    assert not ok and "lease was taken over by pid 1 on the-other-run" in str(message), message
    assert "\n" not in str(message).strip(), message  # one line
    assert _writes(s3, prefix) == []  # nothing put or deleted by any process: the driver's nor a worker's
    assert json.loads(out.read_bytes(LOCK_NAME)) == theirs  # the other run's lease is left as it is


def test_workers_on_other_hosts_get_no_path_of_the_driver(monkeypatch):
    monkeypatch.setenv("HF_HOME", "/driver/hf")
    monkeypatch.setenv("LATENTFORGE_CACHE_DIR", "~/driver-cache")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_never_passed")
    monkeypatch.setenv("LATENTFORGE_ALERT_WEBHOOK", "https://hooks.example/T0/secret")
    local = runners.worker_env("http://api")
    remote = runners.worker_env("http://api", other_hosts=True)
    assert local["HF_HOME"] == "/driver/hf" and local["LATENTFORGE_CACHE_DIR"] == "~/driver-cache"
    assert "HF_HOME" not in remote and "LATENTFORGE_CACHE_DIR" not in remote
    assert remote["HF_ENDPOINT"] == "http://127.0.0.1:9" and remote["PREFECT_API_URL"] == "http://api"
    assert not {"HF_TOKEN", "PREFECT_API_KEY", "LATENTFORGE_ALERT_WEBHOOK"} & (
        set(local) | set(remote)
    )  # Ray logs a task's runtime env
