"""OUT in an object store (``--out s3://BUCKET/PREFIX``): a build writes the objects a local build writes, byte for
byte; it resumes without sending a done sample again; a run killed mid-shard resumes and ends the same; nothing is
overwritten; a second writer meets the lease; a store that refuses writes stops the run with one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.terminal_run import run_build
from infra import outdir
from infra.cache.lock import LOCK_NAME, LockedError, out_lock
from infra.errors import ConfigError
from infra.outstore import StoreOut
from infra.storage import atomic_write
from tests.conftest import assert_same_cache, config, make_shards, sample, tree_files
from tests.media_utils import cut_clip
from tests.s3_proxy import LoopbackS3, loopback_s3

ACCESS_KEY, SECRET_KEY = "AKIDSTOREOUTTEST", "store-out-secret-never-written"
BUCKET = "lf-out"
SHARDS = 2
#: The PUTs a build to a store sends: two a sample encoded (its file, and the journal part its in-progress mark goes in,
#: with the rows kept); a shard's last journal part, its sealed ledger and its listing; a run's lock (and a heartbeat),
#: plan index, pending cache.json and cache.json, reports (measured: 4 samples in 2 shards, 21 PUTs).
PUTS_PER_SAMPLE, PUTS_PER_SHARD, PUTS_PER_RUN = 2, 3, 9


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackS3]:
    """moto's server on 127.0.0.1 behind the counting proxy; the AWS chain aimed at the proxy for the module."""
    with loopback_s3(BUCKET, ACCESS_KEY, SECRET_KEY, tmp_path_factory.mktemp("aws")) as store:
        yield store


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
    """Byte for byte the local build's files, in two PUTs a sample plus a constant a shard and a run."""
    local = tmp_path / "local"
    ok, result = run_build(config(shards, tiny_model, local, workers=1))
    assert ok, result
    s3.proxy.reset()
    ok, result = run_build(config(shards, tiny_model, f"s3://{BUCKET}/cache", workers=1))  # type: ignore[arg-type]
    assert ok, result
    most = PUTS_PER_SAMPLE * result["done"] + PUTS_PER_SHARD * SHARDS + PUTS_PER_RUN
    assert s3.proxy.counts["PUT"] <= most, dict(s3.proxy.counts)
    assert_same_cache(s3.objects(BUCKET, "cache"), tree_files(local))


def test_a_second_run_resumes_without_sending_a_done_sample_again(s3, shards, tiny_model):
    """The build of the test above, run again: no sample object is put again, the objects are unchanged."""
    url = f"s3://{BUCKET}/resume"
    ok, result = run_build(config(shards, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    before = s3.objects(BUCKET, "resume")
    s3.proxy.reset()
    ok, result = run_build(config(shards, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    assert s3.proxy.counts["PUT"] <= PUTS_PER_SHARD * SHARDS + PUTS_PER_RUN, dict(s3.proxy.counts)  # no sample
    after = s3.objects(BUCKET, "resume")
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
