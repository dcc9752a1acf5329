"""OUT in an object store (``--out s3://BUCKET/PREFIX``): a build writes the objects a local build writes, byte for
byte; it resumes without sending a done sample again; a run killed mid-shard resumes and ends the same; nothing is
overwritten; a second writer meets the lease; a store that refuses writes stops the run with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.terminal_run import run_build
from infra import outdir, outstore, storage
from infra.cache.lock import LOCK_NAME, LockedError, out_lock
from infra.errors import ConfigError
from infra.outstore import StoreOut
from infra.storage import atomic_write
from tests.conftest import assert_same_cache, config, make_shards, sample, tree_files
from tests.media_utils import cut_clip
from tests.s3_proxy import LOST, RESET, SLOW_DOWN_FAULT, LoopbackS3, module_s3

ACCESS_KEY, SECRET_KEY = "AKIDSTOREOUTTEST", "store-out-secret-never-written"
BUCKET = "lf-out"
SHARDS = 2
#: The PUTs a build to a store sends: two a sample encoded (its file, and the journal part its in-progress mark goes in,
#: with the rows kept); a shard's last journal part, its sealed ledger and its listing; a run's lock (and a heartbeat),
#: plan index, pending cache.json and cache.json, reports (measured: 4 samples in 2 shards, 21 PUTs).
PUTS_PER_SAMPLE, PUTS_PER_SHARD, PUTS_PER_RUN = 2, 3, 9
#: Every request of a build (of a resume) to a store but its PUTs and the source's reads, all a run's and its shards':
#: no sample is asked about by a HEAD (a listing of its folder answers: `infra.outstore.StoreOut.snapshot`); measured
#: (4 samples in 2 shards, 2 group folders) 92 and 171, of which the resume's verify, stale gate, sanity and reconcile
#: read the ledgers and the plan again, and verify loads its spot-check samples (8 at most); each budget a few above.
BUILD_READS, RESUME_READS = 100, 180


s3 = module_s3(BUCKET, ACCESS_KEY, SECRET_KEY)


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
    assert _out_reads(s3) <= BUILD_READS, dict(s3.proxy.counts)
    assert_same_cache(s3.objects(BUCKET, "cache"), tree_files(local))


def _out_reads(s3: LoopbackS3) -> int:
    """The requests the proxy counted but PUTs (the source here is local: every one is OUT's)."""
    return sum(n for kind, n in s3.proxy.counts.items() if kind != "PUT")


def test_a_second_run_resumes_without_sending_a_done_sample_again(s3, shards, tiny_model):
    """A build whose sample PUTs meet a 503 SlowDown, a reset connection and a lost answer (written, then the
    connection reset: its retry meets its own object) ends whole and counts its retries in the run report; run again,
    no sample object is put again, none is asked about one by one, the objects are unchanged."""
    url = f"s3://{BUCKET}/resume"
    s3.proxy.fault([SLOW_DOWN_FAULT, RESET, LOST], ".pt", kinds=("PUT",))
    ok, result = run_build(config(shards, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    assert not s3.proxy.faults and result["failed"] == 0 and result["done"] == 4, result
    retried = result["store_retries"]
    assert retried.get("slow_down") == 1 and retried.get("connection", 0) >= 1, retried
    out = StoreOut.of(url)
    (report,) = [
        e.name for e in outdir.entries(out, "reports") if e.name.startswith("run-") and e.name.endswith("json")
    ]
    assert json.loads(outdir.read_text(out, f"reports/{report}"))["store_retries"] == retried
    before = s3.objects(BUCKET, "resume")
    s3.proxy.reset()
    ok, result = run_build(config(shards, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert ok, result
    assert s3.proxy.counts["PUT"] <= PUTS_PER_SHARD * SHARDS + PUTS_PER_RUN, dict(s3.proxy.counts)  # no sample
    assert _out_reads(s3) <= RESUME_READS, dict(s3.proxy.counts)
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


def test_a_conditional_put_whose_answer_was_lost_meets_itself_and_is_done(s3):
    """A no-clobber put the store wrote but whose answer was lost is retried by the client and meets its own object
    (a 412): done, not refused; other bytes there are still refused."""
    out = StoreOut.of(f"s3://{BUCKET}/lost")
    s3.proxy.fault([LOST], "lost/a/x.bin", kinds=("PUT",))
    atomic_write("a/x.bin", b"mine", out=out)
    assert not s3.proxy.faults and outdir.read_bytes(out, "a/x.bin") == b"mine"
    with pytest.raises(FileExistsError):
        atomic_write("a/x.bin", b"theirs", out=out)


def test_a_file_past_the_memory_spool_is_sent_from_a_local_temp_file(s3, monkeypatch):
    """A file larger than what is kept in memory (a shard format's part) is spooled to a temp file and sent from it in
    one conditional PUT: the same bytes arrive; its lost answer meets its own object; other bytes are refused."""
    monkeypatch.setattr(storage, "SPOOL_IN_MEMORY", 4096)
    out, data = StoreOut.of(f"s3://{BUCKET}/spooled"), bytes(range(256)) * 400
    s3.proxy.fault([LOST], "spooled/shards/p.tar", kinds=("PUT",))
    with storage.atomic_file("shards/p.tar", out=out) as fh:
        for start in range(0, len(data), 1000):
            fh.write(data[start : start + 1000])
    assert not s3.proxy.faults and outdir.read_bytes(out, "shards/p.tar") == data
    assert fh.written is not None and fh.written.bytes == len(data)
    with pytest.raises(FileExistsError), storage.atomic_file("shards/p.tar", out=out) as other:
        other.write(data[::-1])


def test_a_listing_snapshot_answers_as_the_store_does_page_by_page(s3, monkeypatch):
    """Inside `snapshot` a file's existence and size are answered by listing its folder a page at a time (pages of 3
    here), moved on or started again at the name asked; this process's puts and deletes are seen; the answers are
    those the store gives outside it, without a HEAD."""
    monkeypatch.setattr(outstore, "PAGE", 3)
    out = StoreOut.of(f"s3://{BUCKET}/snap")
    names = [f"g/s{i:02d}.pt" for i in range(0, 20, 2)]  # s00, s02, ... s18: the odd ones are absent
    for i, rel in enumerate(names):
        atomic_write(rel, b"x" * (i + 1), out=out)
    atomic_write("g/s07/inner.bin", b"folder", out=out)  # a folder among the files
    asked = [f"g/s{i:02d}.pt" for i in (*range(20), 15, 3, 19, 0)] + ["g/s07", "g/zz.pt", "g/a.pt", "h/s00.pt"]
    truth = {rel: (outdir.size(out, rel), outdir.is_dir(out, rel)) for rel in asked}
    s3.proxy.reset()
    with outdir.snapshot(out):
        assert {rel: (outdir.size(out, rel), outdir.is_dir(out, rel)) for rel in asked} == truth
        atomic_write("g/s01.pt", b"new", out=out)
        outdir.unlink(out, "g/s02.pt")
        assert outdir.size(out, "g/s01.pt") == 3 and outdir.lstat(out, "g/s02.pt") is None
    assert s3.proxy.counts["HEAD"] == 0 and s3.proxy.counts["LIST"] <= 12, dict(s3.proxy.counts)
    assert outdir.size(out, "g/s01.pt") == 3 and outdir.lstat(out, "g/s02.pt") is None


def test_a_url_with_credentials_is_refused():
    with pytest.raises(ConfigError, match="credentials"):
        StoreOut.of(f"s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/cache")


def test_out_as_a_setting_is_a_store_for_a_url_and_a_home_expanded_folder_else(monkeypatch, tmp_path):
    """`outdir.of_setting`, the one reading of ``--out`` / a config's ``out`` (the plan, the preflight, the CLI's lock
    check and `rerun` share it): a URL is a StoreOut, a local setting the folder with ``~`` expanded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert outdir.of_setting(f"s3://{BUCKET}/cache") == StoreOut.of(f"s3://{BUCKET}/cache")
    assert outdir.of_setting("~/cache") == tmp_path / "cache"
    assert outdir.of_setting("rel/cache") == Path("rel/cache")
