"""Sources in an object store: every source kind read from a loopback S3 (moto's server behind a counting proxy,
`tests/s3_proxy.py`) builds the same sample files as from local disk; a changed object is stale; a 503 SlowDown, a
reset connection and a short range answer are retried and counted in the run report; a vanished object is its
sample's row; the test's keys never reach OUT or the logs. One build a kind and a place, shared by the module."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import random
import shutil
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from flows.cli import app
from flows.cli_options import describe
from flows.terminal_run import run_build
from infra import fetch
from infra.audit.decode_verify import decode_and_verify
from infra.audit.run_report import latest_run_report
from infra.config import BuildConfig
from infra.errors import InputError, SourceError
from infra.faults import HOLD_ENV, LOG_ENV
from infra.plan import make_spec
from infra.preprocess.read import read
from infra.sources import open_source, retries, store
from tests import fakehub
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.image_media import StillImage, sample_images, suffix, write_folder, write_wds
from tests.media_utils import cut_clip
from tests.s3_proxy import RESET, SHORT, SLOW_DOWN_FAULT, Proxy, loopback_s3

ACCESS_KEY, SECRET_KEY = "AKIDSTORESOURCETEST", "store-source-secret-never-written"
BUCKET = "lf-sources"
MISSING_BUCKET = "lf-no-such-bucket"
IMAGE_HEIGHT, IMAGE_WIDTH = 32, 48
KINDS = ("vbvr", "wds", "folder", "meta")
fake_hub, hub_env = fakehub.fake_hub, fakehub.hub_env  # the fixtures, by name
SAMPLES, MEMBER_BYTES = 4, 1 << 20  # the listing test's tar: members far larger than its read-ahead
#: The faults the vbvr build from S3 goes through, in its GETs of the tar: each kind twice (a reset twice in a row:
#: aiohttp asks again once, below botocore and uncounted, when a kept-alive connection is reset).
FAULTS = [SLOW_DOWN_FAULT, RESET, RESET, SHORT] * 2


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """moto's server on 127.0.0.1 behind the counting proxy; the AWS chain aimed at the proxy for the module."""
    with loopback_s3(BUCKET, ACCESS_KEY, SECRET_KEY, tmp_path_factory.mktemp("aws")) as store:
        yield store.proxy


def _client() -> Any:
    return boto3.client("s3")


def _upload(local: Path, prefix: str) -> None:
    """Every file under `local` (or the file) to ``s3://BUCKET/prefix/...``, at the same relative paths."""
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for path in files:
        rel = path.name if local.is_file() else path.relative_to(local).as_posix()
        _client().put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=path.read_bytes())


@pytest.fixture(scope="module")
def image_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "kl-none"
    result = CliRunner().invoke(
        app, ["make-tiny-model", str(out), "--family", "image", "--vae", "kl", "--text", "none"]
    )
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def sources(
    s3: Proxy, tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes], tiny_model: Path
) -> dict[str, tuple]:
    """Per kind: (the local source, the same files' source on the loopback S3)."""
    root = tmp_path_factory.mktemp("store-sources")
    videos = [cut_clip(clips["bikes"], 6, width=160), cut_clip(clips["carphone"], 6)]
    vbvr = make_shards(root / "vbvr", {"part-00000": [sample(0, i, v, b"clip %d" % i) for i, v in enumerate(videos)]})
    images = sample_images()[:3]
    wds = write_wds(root / "wds" / "000.tar", images)
    folder = write_folder(root / "folder", images)
    meta = root / "meta"
    for image in images:
        (meta / "media").mkdir(parents=True, exist_ok=True)
        (meta / "media" / f"{image.key}.{suffix(image.data)}").write_bytes(image.data)
    rows = [{"video": f"media/{i.key}.{suffix(i.data)}", "caption": i.caption} for i in images]
    (meta / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for kind in KINDS:
        _upload(root / kind, kind)
    _upload(tiny_model, "models/tiny-wan22")
    url = f"s3://{BUCKET}"
    return {
        "vbvr": (f"vbvr:{vbvr}", f"vbvr:{url}/vbvr"),
        "wds": (f"wds:{wds}", f"wds:{url}/wds/{{000..000}}.tar"),
        "folder": (f"folder:{folder}", f"folder:{url}/folder"),
        "meta": (f"meta:{meta / 'data.jsonl'}", f"meta:{url}/meta/data.jsonl"),
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _config(kind: str, spec: str, out: Path, tiny_model: Path | str, image_model: Path) -> Any:
    if kind == "vbvr":
        return config(Path("-"), tiny_model, out, source=spec, workers=1)  # type: ignore[arg-type]
    values = {"source": spec, "family": None, "height": IMAGE_HEIGHT, "width": IMAGE_WIDTH, "frames": 1}
    return config(Path("-"), image_model, out, workers=1, **values)


@pytest.fixture(scope="module")
def builds(
    s3: Proxy, sources: dict[str, tuple], tiny_model: Path, image_model: Path, tmp_path_factory
) -> dict[str, Any]:
    """Each kind built from local files and from S3 (the vbvr build through the injected `FAULTS`), with every log
    record of the S3 builds kept."""
    root = tmp_path_factory.mktemp("store-builds")
    records = _Records()
    logging.getLogger().addHandler(records)
    noisy = [logging.getLogger(name) for name in ("infra", "s3fs", "fsspec")]
    levels = [logger.level for logger in noisy]
    for logger in noisy:
        logger.setLevel(logging.DEBUG)
    results: dict[str, Any] = {"outs": {}, "logs": records.lines}
    try:
        for kind in KINDS:
            local, remote = sources[kind]
            ok, result = run_build(_config(kind, local, root / f"{kind}-local", tiny_model, image_model))
            assert ok, result
            if kind == "vbvr":
                s3.fault(FAULTS, "/vbvr/")
            s3.reset()
            model = f"s3://{BUCKET}/models/tiny-wan22" if kind == "vbvr" else image_model  # the model by URL too
            ok, result = run_build(_config(kind, remote, root / f"{kind}-s3", model, image_model))
            assert ok, result
            results[kind] = {"result": result, "counts": dict(s3.counts), "faults": s3.faults_sent}
            results["outs"][kind] = (root / f"{kind}-local", root / f"{kind}-s3")
    finally:
        logging.getLogger().removeHandler(records)
        for logger, level in zip(noisy, levels, strict=True):
            logger.setLevel(level)
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_from_s3_builds_the_same_sample_files_as_from_disk(builds, kind):
    local, remote = builds["outs"][kind]
    ours = {k: v for k, v in tree_hashes(remote).items() if k.split("/")[0] not in ("ledger", "reports")}
    theirs = {k: v for k, v in tree_hashes(local).items() if k.split("/")[0] not in ("ledger", "reports")}
    samples = {k for k in theirs if k.endswith(".pt")}
    assert samples and {k: ours.get(k) for k in samples} == {k: theirs[k] for k in samples}
    assert builds[kind]["result"]["done"] == len(samples) and builds[kind]["result"]["failed"] == 0


def test_a_model_in_s3_has_the_fingerprint_of_the_same_files_on_disk(builds):
    """The vbvr build from S3 read its model from S3 too (fetched into the machine's cache): same fingerprint."""
    local, remote = builds["outs"]["vbvr"]
    fingerprints = [json.loads((out / "cache.json").read_text())["fingerprint"] for out in (local, remote)]
    assert fingerprints[0] == fingerprints[1]
    fetched = list((Path(os.environ["LATENTFORGE_CACHE_DIR"]) / "models").glob(f"*/{fetch.MANIFEST}"))
    assert len(fetched) == 1 and (fetched[0].parent / "vae").is_dir()


def test_a_model_on_the_hub_fetches_its_components_only(hub_env, tiny_model, tmp_path):
    """``--model hf://ORG/NAME``: the components and description files, not the transformer; the fingerprint is the
    local folder's."""
    files = {p.relative_to(tiny_model).as_posix(): p.read_bytes() for p in tiny_model.rglob("*") if p.is_file()}
    hub_env.create("org/tiny-wan22", private=False)
    hub_env.commit("org/tiny-wan22", {**files, "transformer/diffusion_pytorch_model.safetensors": b"\0" * 4096})
    local = make_spec(config(Path("-"), tiny_model, tmp_path / "a"))[1].fingerprint()
    remote = make_spec(config(Path("-"), "hf://org/tiny-wan22@main", tmp_path / "b"))[1].fingerprint()  # type: ignore[arg-type]
    assert local == remote
    fetched = [r.path for r in hub_env.requests if "/resolve/" in r.path]
    assert fetched and not any("transformer" in path for path in fetched)
    assert any(path.endswith("vae/diffusion_pytorch_model.safetensors") for path in fetched)


def test_a_vbvr_source_on_the_hub_builds_the_same_files(hub_env, sources, builds, tiny_model, tmp_path, caplog):
    """``vbvr:hf://datasets/ORG/NAME/PATH``: the same sample files as from disk; the token is written nowhere; a 429 on
    a read of the tar is asked again by huggingface_hub and counted in the run report."""
    local_spec, _ = sources["vbvr"]
    tar = Path(local_spec.removeprefix("vbvr:")) / "part-00000.tar"
    hub_env.create("org/vbvr", private=True)
    hub_env.commit("org/vbvr", {"data/part-00000.tar": tar.read_bytes()})
    hub_env.download_faults([429], "/resolve/main/data/part-00000.tar")
    caplog.set_level(logging.INFO)
    out = tmp_path / "hub-out"
    retries.take()
    ok, result = run_build(_config("vbvr", "vbvr:hf://datasets/org/vbvr@main/data", out, tiny_model, tiny_model))
    assert ok, result
    assert 429 in [r.status for r in hub_env.requests]
    report = latest_run_report(out)
    assert report is not None and report.store_retries == result["store_retries"] == {"slow_down": 1}, report
    local = builds["outs"]["vbvr"][0]
    ours, theirs = tree_hashes(out), tree_hashes(local)
    samples = {k for k in theirs if k.endswith(".pt")}
    assert samples and {k: ours.get(k) for k in samples} == {k: theirs[k] for k in samples}
    token = os.environ["HF_TOKEN"]
    assert not any(token.encode() in p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert caplog.text and token not in caplog.text


def test_transient_store_errors_are_retried_and_counted_in_the_run_report(builds):
    """Two 503 SlowDowns, two pairs of resets, two short range answers: the build finished with the files of the
    local build (the test above) and its run report counts each retry by kind; a local build's report has no count."""
    assert builds["vbvr"]["faults"] == len(FAULTS)
    local, remote = (latest_run_report(out) for out in builds["outs"]["vbvr"])
    assert remote is not None and remote.store_retries is not None, remote
    counted = remote.store_retries
    assert sorted(counted) == ["connection", "short_read", "slow_down"], counted
    # each 503 is a retry; a reset pair one or two (the first on a fresh connection is botocore's too); a short answer
    # that held what the tar reader asked for is no fault to it
    assert counted["slow_down"] == 2 and 2 <= counted["connection"] <= 4 and 1 <= counted["short_read"] <= 2, counted
    assert builds["vbvr"]["result"]["store_retries"] == remote.store_retries
    (written,) = (builds["outs"]["vbvr"][0] / "reports").glob("run-*.json")
    assert local is not None and local.store_retries is None and "store_retries" not in written.read_text()


def test_listing_reads_tar_headers_not_members(s3, tmp_path):
    """Listing a vbvr shard in S3 fetches its headers (and a read-ahead after each), not its members; reading a
    sample fetches that sample's bytes only."""
    members = [sample(0, i, random.Random(i).randbytes(MEMBER_BYTES), b"clip %d" % i) for i in range(SAMPLES)]
    tar = make_shards(tmp_path / "big", {"part-00000": members}) / "part-00000.tar"
    _upload(tar, "big")
    source = open_source(f"vbvr:s3://{BUCKET}/big")
    s3.reset()
    (shard,) = source.shards()
    listing = source.samples(shard)  # the tar stays open while its samples are iterated
    refs = [next(listing) for _ in range(SAMPLES)]
    listed = s3.bytes_out
    assert listed < tar.stat().st_size / 20, (listed, tar.stat().st_size)
    s3.reset()
    assert refs[1].read_media() == members[1].files["ground_truth.mp4"]
    assert MEMBER_BYTES <= s3.bytes_out < MEMBER_BYTES + 2 * store.TAR_BLOCK + 4096
    listing.close()


@pytest.mark.parametrize("kind", ["vbvr", "wds"])
def test_a_samples_prompt_and_media_are_read_in_one_range_request(s3, tmp_path, kind):
    """Where a sample's prompt and media lie side by side in a plain tar in the store, reading the sample (as the
    shard loop does, `infra.preprocess.read.read`) sends one range request, not two: the members' bytes, their
    sha256s noted as each reader alone notes them."""
    if kind == "vbvr":
        members = [sample(0, i, random.Random(i).randbytes(MEMBER_BYTES), b"clip %d" % i) for i in range(SAMPLES)]
        tar = make_shards(tmp_path / kind, {"part-00000": members}) / "part-00000.tar"
        wanted = [(m.files["prompt.txt"].decode(), m.files["ground_truth.mp4"]) for m in members]
    else:
        png = b"\x89PNG\r\n\x1a\n"  # a member named as an image; its bytes are not decoded here
        images = [StillImage(f"k{i}", png + random.Random(i).randbytes(MEMBER_BYTES), f"caption {i}", "RGB")
                  for i in range(SAMPLES)]  # fmt: skip
        tar = write_wds(tmp_path / kind / "part-00000.tar", images)
        wanted = [(image.caption, image.data) for image in images]
    _upload(tar, f"together-{kind}")
    source = open_source(f"{kind}:s3://{BUCKET}/together-{kind}")
    (shard,) = source.shards()
    noted = []
    with contextlib.closing(source.samples(shard)) as listing:
        for ref, (caption, media) in zip(listing, wanted, strict=True):
            s3.reset()
            raw = read(ref)
            assert s3.counts["GET_RANGE"] == 1 and sum(s3.counts.values()) == 1, dict(s3.counts)
            assert (raw.prompt, raw.media) == (caption, media)
            noted.append(ref.identity.read_sha256)
    with contextlib.closing(source.samples(shard)) as listing:  # each member read alone: two range requests
        for ref, sha256s in zip(listing, noted, strict=True):
            s3.reset()
            read(dataclasses.replace(ref, read_together=None))
            assert s3.counts["GET_RANGE"] == 2, dict(s3.counts)
            assert ref.identity.read_sha256 == sha256s and len(sha256s) == 2


def test_a_tar_read_is_pinned_to_the_object_listed(s3, tmp_path):
    """Reading a vbvr sample from S3 asks no HEAD (every range request carries the listed object's ETag); a tar
    rewritten mid-run ends its next sample's read as shard_changed, a deleted one as shard_vanished, never the run."""
    members = [sample(0, i, random.Random(i).randbytes(MEMBER_BYTES), b"clip %d" % i) for i in range(SAMPLES)]
    tar = make_shards(tmp_path / "pinned", {"part-00000": members}) / "part-00000.tar"
    _upload(tar, "pinned")
    source = open_source(f"vbvr:s3://{BUCKET}/pinned")
    (shard,) = source.shards()
    listing = source.samples(shard)
    refs = [next(listing) for _ in range(SAMPLES)]
    s3.reset()
    assert refs[0].read_media() == members[0].files["ground_truth.mp4"]
    assert s3.counts["HEAD"] == 0 and s3.counts["GET_RANGE"] >= 1, dict(s3.counts)
    _client().put_object(Bucket=BUCKET, Key="pinned/part-00000.tar", Body=tar.read_bytes()[::-1])
    with pytest.raises(InputError) as caught:
        refs[1].read_media()
    assert caught.value.reason == "shard_changed", caught.value
    _client().delete_object(Bucket=BUCKET, Key="pinned/part-00000.tar")
    with pytest.raises(InputError) as caught:
        refs[2].read_media()
    assert caught.value.reason == "shard_vanished", caught.value
    listing.close()


def _padded_wds(path: Path, images: list[Any]) -> Path:
    """A WebDataset tar of `images` whose samples lie far apart (a ``.json`` of 4 × the tar reads' block each,
    recorded, not read): reading one sample's image is a range request of its own, not a block read before."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for image in images:
            pad = json.dumps({"mode": image.mode, "pad": "x" * 4 * store.TAR_BLOCK}).encode()
            for name, data in ((f"{image.key}.{suffix(image.data)}", image.data), (f"{image.key}.txt",
                               image.caption.encode()), (f"{image.key}.json", pad)):  # fmt: skip
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_700_000_000
                tf.addfile(info, io.BytesIO(data))
    return path


def test_a_wds_tar_rewritten_mid_run_ends_its_next_samples_as_shard_changed(s3, image_model, tmp_path, monkeypatch):
    """A ``wds:`` build from S3 whose tar is rewritten while the build waits after its first row (one sample read at
    a time): a sample read after it ends as shard_changed (its range reads are pinned to the ETag listed), never the
    run nor another file's bytes."""
    images = sample_images()[:3]
    _upload(_padded_wds(tmp_path / "src" / "000.tar", images), "wds-changed")
    hold, points = tmp_path / "hold", tmp_path / "points.log"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, f"sample:1={hold}")
    monkeypatch.setenv(LOG_ENV, str(points))
    spec = f"wds:s3://{BUCKET}/wds-changed/000.tar"
    ended: dict[str, Any] = {}
    wanted = _config("wds", spec, tmp_path / "out", "-", image_model).with_values(prefetch=0, text_batch=1)
    build = threading.Thread(target=lambda: ended.update(result=run_build(wanted)), daemon=True)
    build.start()
    try:
        deadline = time.monotonic() + 120
        while not (points.exists() and "sample" in points.read_text().split()):
            assert time.monotonic() < deadline and build.is_alive(), "the build's first row never came"
            time.sleep(0.05)
        rewritten = _padded_wds(tmp_path / "other" / "000.tar", images[::-1])
        _client().put_object(Bucket=BUCKET, Key="wds-changed/000.tar", Body=rewritten.read_bytes())
    finally:
        hold.unlink()
        build.join(timeout=120)
    ok, result = ended["result"]
    assert ok, result
    assert result["done"] >= 1 and result["reasons"].get("shard_changed", 0) >= 1, result
    assert result["done"] + result["reasons"]["shard_changed"] == len(images), result  # no other outcome


def test_the_keys_never_reach_out_or_the_logs(builds):
    secrets = (ACCESS_KEY.encode(), SECRET_KEY.encode())
    for _, remote in builds["outs"].values():
        for path in (p for p in remote.rglob("*") if p.is_file()):
            data = path.read_bytes()
            assert not any(s in data for s in secrets), path
    logs = "\n".join(builds["logs"])
    assert logs and not any(s.decode() in logs for s in secrets)


def test_a_changed_object_is_stale(s3, sources, builds, image_model, tiny_model):
    """An object rewritten after the build (same size, new version) stops the next run at the stale gate."""
    _, remote = sources["folder"]
    out = builds["outs"]["folder"][1]
    listed = _client().list_objects_v2(Bucket=BUCKET, Prefix="folder/")["Contents"]
    key = next(o["Key"] for o in listed if o["Key"].endswith(".txt"))
    body = _client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    _client().put_object(Bucket=BUCKET, Key=key, Body=body.swapcase())
    try:
        copy = out.parent / "folder-stale"
        shutil.copytree(out, copy)
        ok, result = run_build(_config("folder", remote, copy, tiny_model, image_model))
        assert not ok and "stale" in str(result).lower(), result
    finally:
        _client().put_object(Bucket=BUCKET, Key=key, Body=body)


def test_a_vanished_object_is_its_samples_row(s3, sources):
    """A media object deleted after the listing ends that sample's row (source_vanished), never the run."""
    _, remote = sources["meta"]
    source = open_source(remote)
    shard = source.shards()[0]
    refs = list(source.samples(shard))
    key = f"meta/{refs[0].id}"
    body = _client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    _client().delete_object(Bucket=BUCKET, Key=key)
    try:
        with pytest.raises(InputError) as caught:
            refs[0].read_media()
        assert caught.value.reason == "source_vanished", caught.value
        assert refs[1].read_media()
    finally:
        _client().put_object(Bucket=BUCKET, Key=key, Body=body)


def test_a_url_with_credentials_is_refused_and_never_echoed():
    for values in (
        {"source": f"vbvr:s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/x"},
        {"model": f"s3://k:{SECRET_KEY}@b/m"},
    ):
        with pytest.raises(ValidationError) as caught:
            BuildConfig(**{"source": "vbvr:/data", "model": "/m", "out": "/o", **values})
        said = describe(caught.value)
        assert "user:password@" in said and "is refused" in said and SECRET_KEY not in said


def test_a_metadata_file_in_a_store_reads_only_below_its_folder(s3):
    """Rows of a metadata file in S3 with ``..``, an absolute path or a URL of their own are not read."""
    rows = [
        {"video": "media/astronaut.png", "caption": "inside", "audio": "../outside.wav"},
        {"video": "/etc/passwd.mp4", "caption": "absolute"},
        {"video": "../meta/media/astronaut.png", "caption": "up and back"},
    ]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    _client().put_object(Bucket=BUCKET, Key="meta/hostile.jsonl", Body=body)
    source = open_source(f"meta:s3://{BUCKET}/meta/hostile.jsonl")
    refs = [ref for shard in source.shards() for ref in source.samples(shard)]
    assert [ref.problem.kind.value if ref.problem else None for ref in refs] == [
        "outside_source",
        "outside_source",
        "bad_layout",
    ]


@pytest.mark.parametrize(
    ("source", "model", "reason"),
    [
        (f"vbvr:s3://{MISSING_BUCKET}/vbvr", None, f"the bucket '{MISSING_BUCKET}' does not exist"),
        (f"meta:s3://{MISSING_BUCKET}/meta/data.jsonl", None, f"the bucket '{MISSING_BUCKET}' does not exist"),
        ("vbvr:LOCAL", f"s3://{MISSING_BUCKET}/models/tiny", "The specified bucket does not exist"),  # s3fs's words
        (f"vbvr:s3://{BUCKET}/refused", None, "Access Denied"),
    ],
    ids=["source-bucket-missing", "meta-bucket-missing", "model-bucket-missing", "access-denied"],
)
def test_a_store_that_refuses_stops_the_build_at_once_with_one_line(
    s3, sources, tiny_model, tmp_path, source, model, reason
):
    """A bucket that does not exist, or a store that answers 403 AccessDenied to everything: ``latentforge build``
    ends before any flow with one ``error:`` line naming the URL and why, the exit code of a source error, OUT
    untouched."""
    source = source.replace("LOCAL", sources["vbvr"][0].removeprefix("vbvr:"))
    out = tmp_path / "out"
    args = ["build", "--source", source, "--model", model or str(tiny_model), "--out", str(out), "--device", "cpu"]
    s3.refuse = reason == "Access Denied"
    try:
        result = CliRunner().invoke(app, args)
    finally:
        s3.refuse = False
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == SourceError.exit_code, result.output
    assert len(errors) == 1 and reason in errors[0] and (model or source.split(":", 1)[1]) in errors[0], result.output
    assert not out.exists()


def test_decode_and_verify_fetches_a_model_its_cache_names_by_url(builds, tmp_path):
    """The vbvr build from S3 recorded its model as ``s3://...``: decode-and-verify without a model folder fetches it
    (as the build did) and decodes against the source in S3, instead of reading the URL as a path."""
    remote = builds["outs"]["vbvr"][1]
    assert json.loads((remote / "cache.json").read_text())["provenance"]["model_path"].startswith("s3://")
    report = decode_and_verify(remote, n=1, device="cpu", report_dir=tmp_path / "decode")
    assert report.ok and len(report.rows) == 1 and not report.problems, report.text()
    assert report.model == f"s3://{BUCKET}/models/tiny-wan22"


def test_a_short_answer_of_a_whole_object_is_asked_again_and_counted(s3, sources):
    """A media object read whole (a metadata row's), answered short (its checksum refutes it) and then slowed down:
    the bytes come whole, both retries counted by kind."""
    _, remote = sources["meta"]
    source = open_source(remote)
    ref = next(source.samples(source.shards()[0]))
    expected = ref.read_media()
    retries.take()
    s3.fault([SHORT, SLOW_DOWN_FAULT], "/meta/media/")
    assert ref.read_media() == expected
    assert s3.faults_sent and not s3.faults and retries.take() == {"short_read": 1, "slow_down": 1}
