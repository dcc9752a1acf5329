"""OUT in an object store (``--out s3://BUCKET/PREFIX``): a build writes the objects a local build writes, byte for
byte; it resumes without sending a done sample again; a run killed mid-shard resumes and ends the same; nothing is
overwritten; a second writer meets the lease; a store that refuses writes stops the run with one line."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from flows.terminal_run import run_build
from infra import outdir
from infra.cache.lock import LOCK_NAME, LockedError, out_lock
from infra.errors import ConfigError
from infra.outstore import StoreOut
from infra.storage import atomic_write
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.s3_proxy import Proxy

ACCESS_KEY, SECRET_KEY = "AKIDSTOREOUTTEST", "store-out-secret-never-written"
BUCKET = "lf-out"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """moto's server on 127.0.0.1 behind the counting proxy; the AWS chain aimed at the proxy for the module."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = Proxy(upstream=f"{host}:{port}")
    proxy.start()
    home = tmp_path_factory.mktemp("aws")
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_CONFIG_FILE": str(home / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        _clear_store_clients()
        boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket=BUCKET)
        try:
            yield proxy
        finally:
            _clear_store_clients()
            proxy.stop()
            server.stop()


def _clear_store_clients() -> None:
    import s3fs  # noqa: PLC0415 - a store's library, as OUT imports it

    s3fs.S3FileSystem.clear_instance_cache()


def _objects(prefix: str) -> dict[str, bytes]:
    """Every object below ``s3://BUCKET/prefix/`` (relative key → bytes), leaving out what `tree_hashes` does."""
    client = boto3.client("s3")
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
        for item in page.get("Contents", []):
            rel = item["Key"][len(prefix) + 1 :]
            if rel != ".latentforge.lock" and rel.split("/")[0] != "reports":
                found[rel] = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
    return dict(sorted(found.items()))


def _files(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in tree_hashes(root)}


def _comparable(rel: str, data: bytes) -> Any:
    """What two builds of the same clips agree on: every byte, but a ledger row's seconds and cache.json's creation
    time (and where it names OUT), the run id in a row."""
    if rel.startswith("ledger/") and rel.endswith(".jsonl") and rel.count("/") == 1:
        rows = [json.loads(line) for line in data.decode().splitlines()]
        return [
            {k: v for k, v in r.items() if k != "seconds"} | {"extra": {**r["extra"], "run_id": None}} for r in rows
        ]
    if rel == "cache.json":
        body = json.loads(data)
        return {k: v for k, v in body.items() if k != "provenance"}
    return hashlib.sha256(data).hexdigest()


def same_objects(ours: dict[str, bytes], theirs: dict[str, bytes]) -> None:
    assert ours.keys() == theirs.keys()
    for rel in ours:
        assert _comparable(rel, ours[rel]) == _comparable(rel, theirs[rel]), rel


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> Path:
    root = tmp_path_factory.mktemp("store-out-src")
    videos = [cut_clip(clips["bikes"], 6, width=160), cut_clip(clips["carphone"], 6)]
    return make_shards(
        root,
        {
            "part-00000": [sample(0, i, v, b"clip %d" % i) for i, v in enumerate(videos)],
            "part-00001": [sample(1, i, v, b"other %d" % i) for i, v in enumerate(videos)],
        },
    )


def test_a_build_to_s3_writes_the_objects_of_a_local_build(s3, shards, tiny_model, tmp_path):
    local = tmp_path / "local"
    ok, result = run_build(config(shards, tiny_model, local, workers=1))
    assert ok, result
    s3.reset()
    ok, result = run_build(config(shards, tiny_model, f"s3://{BUCKET}/cache", workers=1))  # type: ignore[arg-type]
    assert ok, result
    print(dict(s3.counts))
    same_objects(_objects("cache"), _files(local))


def test_a_second_run_resumes_without_sending_a_done_sample_again(s3, shards, tiny_model):
    """The build of the test above, run again: no sample object is put again, the objects are unchanged."""
    url = f"s3://{BUCKET}/resume"
    ok, result = run_build(config(shards, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    before = _objects("resume")
    s3.reset()
    ok, result = run_build(config(shards, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    print("resume", dict(s3.counts))
    after = _objects("resume")
    samples = [rel for rel in before if rel.endswith(".pt")]
    assert samples and {rel: after[rel] for rel in samples} == {rel: before[rel] for rel in samples}
    assert result["encoded"] == 0 and result["reused"] == len(samples)


def test_a_live_lease_stops_a_second_writer_and_an_object_is_never_clobbered(s3):
    out = StoreOut.of(f"s3://{BUCKET}/leased")
    with out_lock(out), pytest.raises(LockedError), out_lock(out):
        pass
    assert outdir.lstat(out, LOCK_NAME) is None  # released
    atomic_write("a/x.bin", b"first", out=out)
    with pytest.raises(FileExistsError):
        atomic_write("a/x.bin", b"second", out=out)
    assert outdir.read_bytes(out, "a/x.bin") == b"first"


def test_a_url_with_credentials_is_refused():
    with pytest.raises(ConfigError, match="credentials"):
        StoreOut.of(f"s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/cache")
