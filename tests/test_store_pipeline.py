"""A build with source and OUT in an object store keeps the encoder busy (issue 40, item 6): a sample's files are put
in the background, its done row committed only once they are in the store, the bytes waiting bounded; the source is
read ahead by a reader thread; a resumed shard with nothing to encode sends no request for its tar's headers."""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import boto3
import pytest

from flows.shards import shard_listing
from infra.cache import ledger, listing
from infra.config import BuildConfig
from infra.formats import get_format
from infra.outstore import StoreOut
from infra.plan import make_plan
from infra.preprocess.one_sample import dry_run
from infra.preprocess.prefetch import Prefetcher
from infra.preprocess.puts import Commits, Pending
from infra.preprocess.read import RawSample
from infra.preprocess.shard import process_shard
from infra.sources import SampleRef
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip
from tests.s3_proxy import module_s3

ACCESS_KEY, SECRET_KEY = "AKIDPIPELINETEST", "pipeline-secret-never-written"
BUCKET = "lf-pipeline"
SAMPLES = 3  # in one shard
PUT_DELAY_S = 0.4  # each sample file's PUT waits this long: a slow store

s3 = module_s3(BUCKET, ACCESS_KEY, SECRET_KEY)


@pytest.fixture(scope="module")
def source(s3, tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> str:
    """One VBVR tar of `SAMPLES` clips, in the store: its URL."""
    video = cut_clip(clips["carphone"], 6, width=96)
    root = make_shards(
        tmp_path_factory.mktemp("pipe-src"), {"part": [sample(0, i, video, b"clip %d" % i) for i in range(SAMPLES)]}
    )
    boto3.client("s3", endpoint_url=s3.direct).put_object(
        Bucket=BUCKET, Key="src/part.tar", Body=(root / "part.tar").read_bytes()
    )
    return f"s3://{BUCKET}/src"


def _config(source: str, model: Path, out: str) -> BuildConfig:
    return config(Path("-"), model, out, source=f"vbvr:{source}", workers=1)  # type: ignore[arg-type]


def _in_store(s3, url: str, rel: str) -> bool:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3.direct)  # past the proxy: what the store holds now
    return client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{rel}").get("KeyCount", 0) > 0


def test_a_done_row_is_committed_only_once_its_files_are_in_the_store(s3, source, tiny_model, tmp_path):
    """Each sample file's PUT is slow: when its row is committed (journalled, then reported), its object is already
    in the store; the rows come in the source's order; a resume of the shard reads no tar header from the store."""
    url = f"s3://{BUCKET}/committed"
    spool = tmp_path / "spool" / "listing"
    plan = make_plan(_config(source, tiny_model, url), spool)
    seen: list[tuple[str, bool]] = []

    def on_row(row: ledger.LedgerRow) -> None:
        seen.append((row.key, row.status == "done" and _in_store(s3, url, row.path or "")))

    s3.proxy.put_delay, s3.proxy.put_delay_match = PUT_DELAY_S, ".pt"
    try:
        result = process_shard(plan.job, plan.shards[0], on_row=on_row, listing=spool)
    finally:
        s3.proxy.put_delay = 0.0
    assert result.counts == {"done": SAMPLES}, result
    assert [done for _, done in seen] == [True] * SAMPLES, seen
    assert [key for key, _ in seen] == sorted(key for key, _ in seen)  # the tar's order
    sealed = StoreOut.of(url).read_bytes(ledger.sealed_rel("part"))

    # resumed with nothing to encode: the plan's listing is taken, the tar is not read again
    plan = make_plan(_config(source, tiny_model, url), spool.with_name("again"))
    s3.proxy.reset()
    result = process_shard(plan.job, plan.shards[0], listing=spool.with_name("again"))
    assert result.reused == SAMPLES and result.encoded == 0, result
    assert _source_reads(s3) == [], s3.proxy.requests
    assert StoreOut.of(url).read_bytes(ledger.sealed_rel("part")) == sealed
    s3.proxy.reset()  # without the plan's listing (a worker that cannot see it): the tar's headers are read
    result = process_shard(plan.job, plan.shards[0])
    assert result.reused == SAMPLES and _source_reads(s3), s3.proxy.requests


def _source_reads(s3) -> list[str]:
    """The GETs (ranged or whole) of the source's objects the proxy saw since its last reset."""
    return [path for kind, path in s3.proxy.requests if kind.startswith("GET") and f"/{BUCKET}/src/" in path]


def test_the_bytes_waiting_for_their_puts_stay_within_the_bound(s3):
    """Eight samples handed over faster than a slow store takes them: at most the bound waits (the shard's thread
    waits for the oldest put), every row is committed in order, once, after its object is in the store."""
    url, size, bound = f"s3://{BUCKET}/bound", 10_000, 25_000
    writer = get_format("pt").writer(StoreOut.of(url))
    committed: list[tuple[int, bool]] = []
    commits = Commits(writer, lambda made, note: committed.append((note, made)), max_bytes=bound, max_samples=8)
    s3.proxy.put_delay, s3.proxy.put_delay_match = 0.1, "/bound/"
    try:
        for i in range(8):
            rel = f"s/{i}.bin"
            finish = functools.partial(_put_and_there, s3, url, rel)
            commits.add(Pending([([], rel, bytes([i]) * size)], False, finish), i)
            assert commits.waiting_bytes <= bound
        commits.drain()
    finally:
        commits.close()
        s3.proxy.put_delay = 0.0
    assert committed == [(i, True) for i in range(8)], committed
    assert size * 2 <= commits.peak_bytes <= bound, commits.peak_bytes  # the puts overlapped, within the bound


def _put_and_there(s3, url: str, rel: str, ended: object) -> bool:
    return not isinstance(ended, BaseException) and _in_store(s3, url, rel)


@pytest.mark.parametrize("threaded", [False, True])
def test_read_ahead_stops_at_a_sample_not_read_ahead_on_its_thread_too(threaded) -> None:
    """The reader thread (a source in a store) reads off the loop's thread, and like the loop's own read-ahead never
    moves the source past a sample kept from the ledger before the loop has visited it."""
    pulled: list[int] = []
    readers: set[str] = set()

    def refs():
        for i in range(6):
            pulled.append(i)
            yield SampleRef(id=str(i), group="g", key=str(i), read_media=lambda: b"v", read_prompt=lambda: b"p")

    def read(ref: SampleRef) -> RawSample:
        readers.add(threading.current_thread().name)
        return RawSample(ref, f"p{ref.key}", b"v")

    kept = {"1", "2"}
    ahead = Prefetcher(
        refs(), read=read, decoders=None, wanted=lambda r: r.key not in kept, depth=0, lookahead=3, threaded=threaded
    )
    seen = []
    for ref in ahead:
        seen.append((ref.key, len(pulled)))
        assert (ahead.take(ref) is None) == (ref.key in kept)
    ahead.close()
    assert [key for key, _ in seen] == [str(i) for i in range(6)]
    assert dict(seen)["0"] == 2 and dict(seen)["1"] == 2 and dict(seen)["2"] == 3  # stops at each kept one
    main = threading.current_thread().name
    assert readers == ({"lf-read-ahead"} if threaded else {main}), readers


def test_a_first_build_of_a_store_tar_makes_its_samples_from_the_plans_listing(
    s3, source, tiny_model, tmp_path, caplog
):
    """A shard task of a tar in the store with samples to encode makes them from the plan's records of its listing
    (no header read again): no more range requests of the tar than a task that lists it (fewer where its headers
    take requests of their own), the same rows and bytes."""
    files: dict[str, dict[str, bytes]] = {}
    reads: dict[str, int] = {}
    caplog.set_level(logging.INFO, logger="infra.preprocess.kept")
    for name, spooled in (("relisted", True), ("listed", False)):
        url, spool = f"s3://{BUCKET}/{name}", tmp_path / name / "listing"
        plan = make_plan(_config(source, tiny_model, url), spool)
        s3.proxy.reset()
        caplog.clear()
        result = process_shard(plan.job, plan.shards[0], listing=spool if spooled else None)
        assert result.counts == {"done": SAMPLES}, result
        assert ("made from the plan's listing" in caplog.text) == spooled
        reads[name] = len(_source_reads(s3))
        out = StoreOut.of(url)
        rows = ledger.read_shard(url, "part")
        files[name] = {row.key: out.read_bytes(row.path or "") for row in rows.values()}
    assert reads["relisted"] <= reads["listed"], reads
    assert reads["relisted"] <= SAMPLES + 1, reads  # a sample's members (one request), the tar's first header
    assert files["relisted"] == files["listed"] and len(files["listed"]) == SAMPLES


def test_the_sanity_sample_of_a_store_tar_is_made_from_the_plans_listing(s3, source, tiny_model, tmp_path, caplog):
    """The one-sample check reads its sample from the plan's records of the tar's listing (its headers not read
    again): no more range requests of the tar than when it lists the tar, the same sample encoded."""
    url, spool = f"s3://{BUCKET}/sanity", tmp_path / "sanity" / "listing"
    plan = make_plan(_config(source, tiny_model, url), spool)
    reads, found = {}, {}
    caplog.set_level(logging.INFO, logger="infra.preprocess.kept")
    for name, spooled in (("relisted", spool), ("listed", None)):
        s3.proxy.reset()
        caplog.clear()
        found[name] = dry_run(plan.job, plan.shards, spooled)
        reads[name] = len(_source_reads(s3))
        assert ("made from the plan's listing" in caplog.text) == (spooled is not None)
    assert found["relisted"] == found["listed"] and found["listed"]["skipped_before"] == []
    assert reads["relisted"] <= reads["listed"], reads
    assert reads["relisted"] <= 2, reads  # the tar's first header, the sample's members (one request)


def test_a_ray_task_carries_its_shards_part_of_the_plans_listing(s3, source, tiny_model, tmp_path, caplog):
    """On Ray a shard task is handed its shard's part of the plan's listing as bytes, never a path of the driver's
    (a worker on another host cannot read it); unpacked in the worker's own temporary folder, its samples are made
    from the plan's records (the tar's headers not read): the same rows and bytes as a task that lists the tar."""
    caplog.set_level(logging.INFO, logger="infra.preprocess.kept")
    relisted = "made from the plan's listing"
    url, spool = f"s3://{BUCKET}/carried", tmp_path / "driver-only" / "listing"
    plan = make_plan(_config(source, tiny_model, url).with_values(runner="ray"), spool)
    carried = shard_listing(plan, "part")
    assert isinstance(carried, dict) and {"listing", "records"} <= set(carried), carried
    assert not any(str(tmp_path).encode() in data for data in carried.values())
    with listing.task_spool(carried, "part") as unpacked:
        assert not unpacked.is_relative_to(tmp_path)
        caplog.clear()
        result = process_shard(plan.job, plan.shards[0], listing=unpacked)
        assert relisted in caplog.text
    assert result.counts == {"done": SAMPLES}, result
    local = make_plan(_config(source, tiny_model, f"s3://{BUCKET}/listed"), tmp_path / "listed" / "listing")
    assert shard_listing(local, "part") == local.listing  # the local runner: the spool's path
    caplog.clear()
    process_shard(local.job, local.shards[0])  # handed no listing: the tar is listed
    assert relisted not in caplog.text
    rows = {name: ledger.read_shard(f"s3://{BUCKET}/{name}", "part") for name in ("carried", "listed")}
    files = {name: {k: StoreOut.of(f"s3://{BUCKET}/{name}").read_bytes(r.path or "") for k, r in rs.items()}
             for name, rs in rows.items()}  # fmt: skip
    assert files["carried"] == files["listed"] and len(files["carried"]) == SAMPLES
