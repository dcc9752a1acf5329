"""Sources and models in Google Cloud Storage, read through gcsfs from a loopback GCS (gcp-storage-emulator in its own
process on 127.0.0.1, the JSON API gcsfs speaks): a vbvr source lists each tar with its size and its generation,
builds the same sample files as from local disk, and a model by ``gs://`` URL has the fingerprint of its local folder;
a sample rewritten in its tar after the build is stale (the same bytes written again are not), a tar rewritten or
deleted mid-read ends its next sample as shard_changed or shard_vanished; a missing bucket is one error line. One
local build and one from GCS, shared by the module."""

from __future__ import annotations

import importlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import fsspec.config
import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra import fetch
from infra.errors import InputError, SourceError
from infra.sources import open_source, store
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.procs import free_port, stop_group, wait_answers

BUCKET = "lf-gcs-sources"
MISSING_BUCKET = "lf-gcs-no-such-bucket"
MODEL_PREFIX = "models/tiny-wan22"
#: The tar of the mid-read test: its samples, each member far larger than a tar read's read-ahead.
SAMPLES, MEMBER_BYTES = 3, 64 * 1024
#: gcsfs's switch, read once when gcsfs is imported: on (its default), its file system first asks the Storage Control
#: gRPC API for a bucket's layout, which the emulator does not serve (60 s of retries a call, never cached). Set off
#: for the whole session by tests/conftest.py, before anything can import gcsfs.
ZONAL_SWITCH = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
MISSING = [name for name in ("gcsfs", "gcp_storage_emulator") if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"gs:// tests need {' and '.join(MISSING)}: pip install -e '.[dev]'"),
    pytest.mark.timeout(180),  # a hung emulator or a credential lookup ends the test, not the suite
]


@dataclass(frozen=True)
class LoopbackGCS:
    url: str  # the emulator's endpoint
    fs: Any  # gcsfs's file system, aimed at it


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackGCS]:
    """The emulator in its own process on a free port of 127.0.0.1, `BUCKET` made; gcsfs aimed at it for the module
    through fsspec's configuration (``endpoint_url``, ``token="anon"``: no credential lookup, no metadata server),
    which is what ``FSSPEC_GCS_ENDPOINT_URL`` / ``FSSPEC_GCS_TOKEN`` give a user's process. Models fetched into a
    cache of the module's own (another module of the session counts the models in the session's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "-H", "127.0.0.1", "--port", str(port)]
    cmd += ["--in-memory", "--default-bucket", BUCKET, "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_answers(f"{url}/", proc, "gcp-storage-emulator", timeout=30)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("gcs-cache")))
            gcsfs = importlib.import_module("gcsfs")  # here, not at the top: the switch is read at its import
            if fsspec.get_filesystem_class("gs") is not gcsfs.core.GCSFileSystem:
                pytest.fail(f"gcsfs was imported with {ZONAL_SWITCH} on: tests/conftest.py sets it off at its start")
            patch.setitem(fsspec.config.conf, "gs", {"endpoint_url": url, "token": "anon"})
            yield LoopbackGCS(url, fsspec.filesystem("gs"))
    finally:
        stop_group(proc, timeout=10)


def _upload(gcs: LoopbackGCS, local: Path, prefix: str) -> None:
    """Every file under `local` (or the file) to ``gs://BUCKET/prefix/...``, at the same relative paths."""
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for path in files:
        rel = path.name if local.is_file() else path.relative_to(local).as_posix()
        gcs.fs.pipe_file(f"{BUCKET}/{prefix}/{rel}", path.read_bytes())


@pytest.fixture(scope="module")
def videos(clips: dict[str, bytes]) -> list[bytes]:
    return [cut_clip(clips["bikes"], 6, width=160), cut_clip(clips["carphone"], 6)]


def _vbvr(root: Path, videos: list[bytes], first_prompt: bytes = b"clip 0") -> Path:
    """The one-tar vbvr source of `videos` under `root` (the first sample's prompt `first_prompt`)."""
    prompts = [first_prompt, *(b"clip %d" % i for i in range(1, len(videos)))]
    samples = [sample(0, i, video, prompt) for i, (video, prompt) in enumerate(zip(videos, prompts, strict=True))]
    return make_shards(root, {"part-00000": samples})


@pytest.fixture(scope="module")
def sources(gcs: LoopbackGCS, tmp_path_factory, videos: list[bytes], tiny_model: Path) -> tuple[str, str]:
    """(the local vbvr source, the same tar's source in GCS); the tiny model uploaded beside it."""
    vbvr = _vbvr(tmp_path_factory.mktemp("gcs-sources") / "vbvr", videos)
    _upload(gcs, vbvr, "vbvr")
    _upload(gcs, tiny_model, MODEL_PREFIX)
    return f"vbvr:{vbvr}", f"vbvr:gs://{BUCKET}/vbvr"


@pytest.fixture(scope="module")
def builds(gcs: LoopbackGCS, sources: tuple[str, str], tiny_model: Path, tmp_path_factory) -> dict[str, Any]:
    """The vbvr source built from local disk with the local model, and from GCS with the model by ``gs://`` URL."""
    root = tmp_path_factory.mktemp("gcs-builds")
    local, remote = sources
    outs = {"local": root / "local", "gcs": root / "gcs"}
    results = {}
    for (name, out), (spec, model) in zip(
        outs.items(), [(local, tiny_model), (remote, f"gs://{BUCKET}/{MODEL_PREFIX}")], strict=True
    ):
        ok, result = run_build(config(Path("-"), model, out, source=spec, workers=1))  # type: ignore[arg-type]
        assert ok, result
        results[name] = result
    return {"outs": outs, "results": results}


def _samples(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(out).items() if k.endswith(".pt")}


def test_a_vbvr_source_in_gcs_lists_each_tar_with_its_size_and_generation(gcs, sources):
    """The listing's version of an object is its GCS generation (what a rewrite changes, whatever the bytes), and the
    tar's samples are the local tar's."""
    local, remote = sources
    tar = Path(local.removeprefix("vbvr:")) / "part-00000.tar"
    info = gcs.fs.info(f"{BUCKET}/vbvr/part-00000.tar")
    assert info["generation"].isdigit(), info
    source = open_source(remote)
    (shard,) = source.shards()
    assert (shard.path, shard.size, shard.version) == (
        f"gs://{BUCKET}/vbvr/part-00000.tar",
        tar.stat().st_size,
        info["generation"],
    )
    assert store.find(remote.removeprefix("vbvr:")) == {shard.path: store.Stat(shard.size, shard.version)}
    local_source = open_source(local)
    (local_shard,) = local_source.shards()
    ids = [ref.id for ref in local_source.samples(local_shard)]
    assert len(ids) == 2 and [ref.id for ref in source.samples(shard)] == ids


def test_a_vbvr_build_from_gcs_makes_the_same_sample_files_as_from_disk(builds):
    local, remote = builds["outs"]["local"], builds["outs"]["gcs"]
    theirs = _samples(local)
    assert len(theirs) == 2 and _samples(remote) == theirs
    assert builds["results"]["gcs"]["done"] == len(theirs) and builds["results"]["gcs"]["failed"] == 0
    cache = json.loads((remote / "cache.json").read_text())
    assert cache["provenance"]["model_path"] == f"gs://{BUCKET}/{MODEL_PREFIX}"


def test_a_model_in_gcs_has_the_fingerprint_of_the_same_files_on_disk(builds):
    """The build from GCS fetched its model from GCS into the machine's cache: the fingerprint is the local folder's."""
    fingerprints = [json.loads((out / "cache.json").read_text())["fingerprint"] for out in builds["outs"].values()]
    assert fingerprints[0] == fingerprints[1]
    (manifest,) = fetch.cache_root().glob(f"*/{fetch.MANIFEST}")
    assert json.loads(manifest.read_text())["url"] == f"gs://{BUCKET}/{MODEL_PREFIX}"
    assert (manifest.parent / "vae").is_dir()


def test_a_sample_rewritten_in_its_tar_after_the_build_is_stale(gcs, sources, builds, videos, tiny_model, tmp_path):
    """The tar written again with the same bytes is a new generation of the same samples: a run of a copy of OUT
    resumes with nothing to encode. Written again with the first sample's prompt revised, the next run stops at the
    stale gate (a sample's identity is its members as listed in the tar, and the bytes it read)."""
    local, remote = sources
    out, path = builds["outs"]["gcs"], f"{BUCKET}/vbvr/part-00000.tar"
    original = (Path(local.removeprefix("vbvr:")) / "part-00000.tar").read_bytes()
    before = store.stat(f"gs://{path}")
    try:
        gcs.fs.pipe_file(path, original)
        assert store.stat(f"gs://{path}").version != before.version
        ok, result = run_build(config(Path("-"), tiny_model, _copy(out, tmp_path / "same"), source=remote, workers=1))
        assert ok and (result["reused"], result["encoded"], result["failed"]) == (2, 0, 0), result
        revised = _vbvr(tmp_path / "revised", videos, first_prompt=b"clip 0, revised") / "part-00000.tar"
        gcs.fs.pipe_file(path, revised.read_bytes())
        ok, result = run_build(config(Path("-"), tiny_model, _copy(out, tmp_path / "stale"), source=remote, workers=1))
        assert not ok and str(result).startswith("StaleAborted: 1 done sample(s)"), result
        assert "/handle_object_reappearance_00000000" in str(result), result  # the first sample, not the second
    finally:
        gcs.fs.pipe_file(path, original)


def _copy(out: Path, to: Path) -> Path:
    shutil.copytree(out, to)
    return to


def test_a_tar_rewritten_mid_read_is_shard_changed_and_a_deleted_one_shard_vanished(gcs, tmp_path):
    """A tar in GCS is not pinned to the object it opened (no ``If-Match``): each sample's read first asks for the
    object's generation, so a rewrite ends the next sample's read as shard_changed, a delete as shard_vanished."""
    members = [sample(0, i, random.Random(i).randbytes(MEMBER_BYTES), b"clip %d" % i) for i in range(SAMPLES)]
    tar = make_shards(tmp_path / "changing", {"part-00000": members}) / "part-00000.tar"
    _upload(gcs, tar, "changing")
    source = open_source(f"vbvr:gs://{BUCKET}/changing")
    (shard,) = source.shards()
    listing = source.samples(shard)
    refs = [next(listing) for _ in range(SAMPLES)]
    try:
        assert refs[0].read_media() == members[0].files["ground_truth.mp4"]
        gcs.fs.pipe_file(f"{BUCKET}/changing/part-00000.tar", tar.read_bytes()[::-1])
        with pytest.raises(InputError) as caught:
            refs[1].read_media()
        assert caught.value.reason == "shard_changed", caught.value
        gcs.fs.rm_file(f"{BUCKET}/changing/part-00000.tar")
        with pytest.raises(InputError) as caught:
            refs[2].read_media()
        assert caught.value.reason == "shard_vanished", caught.value
    finally:
        listing.close()


@pytest.mark.parametrize(
    ("source", "model", "reason"),
    [
        (f"vbvr:gs://{MISSING_BUCKET}/vbvr", None, f"the bucket '{MISSING_BUCKET}' does not exist"),
        ("LOCAL", f"gs://{MISSING_BUCKET}/{MODEL_PREFIX}", "cannot be listed"),  # gcsfs's 404 names no reason
    ],
    ids=["source", "model"],
)
def test_a_missing_bucket_stops_the_build_at_once_with_one_line(
    gcs, sources, tiny_model, tmp_path, source, model, reason
):
    """``latentforge build`` from a bucket that does not exist ends before any flow with one ``error:`` line naming
    the URL, the exit code of a source error, OUT untouched."""
    source = sources[0] if source == "LOCAL" else source
    out = tmp_path / "out"
    args = ["build", "--source", source, "--model", model or str(tiny_model), "--out", str(out), "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == SourceError.exit_code and len(errors) == 1, result.output
    assert reason in errors[0] and (model or source.split(":", 1)[1]) in errors[0], result.output
    assert not out.exists()
