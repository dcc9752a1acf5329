"""The plan of a source of many tars in a store (issue 40): several tars listed at once while the plan counts the one
before (`infra.sources.ahead`), into the plan and spools a listing of the same tars on local disk makes; a tar listed
whole kept on this machine, so that a later plan of the same object reads no header (`infra.sources.listing_cache`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import boto3
import pytest

from infra.cache import listing
from infra.plan import plan_shards
from infra.sources import ahead, listing_cache, open_source
from tests import fakehub
from tests.conftest import config, make_shards, sample
from tests.s3_proxy import module_s3

ACCESS_KEY, SECRET_KEY = "AKIDPLANAHEADTEST", "plan-ahead-secret"
BUCKET = "lf-plan-ahead"
SHARDS, SAMPLES = 6, 3  # tars, samples a tar
MEMBER_BYTES = 40_000  # over the stream's read-ahead (16 KiB): each header of a tar is a range request of its own
LATENCY_S = 0.03  # every request to the store: a far store's round trip

s3 = module_s3(BUCKET, ACCESS_KEY, SECRET_KEY)
fake_hub, hub_env = fakehub.fake_hub, fakehub.hub_env  # the fixtures, by name


@pytest.fixture(autouse=True)
def own_machine_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's own: no listing kept by another test."""
    monkeypatch.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path / "machine-cache"))
    return tmp_path / "machine-cache"


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`SHARDS` tars of `SAMPLES` samples, on local disk and in the store (the same bytes): (folder, URL). The
    fourth tar holds the first tar's first sample again (a duplicate across shards); the last is cut short."""
    shards = {
        f"part-{n:02d}": [
            sample(n % 2, 100 * n + i, bytes([n]) * MEMBER_BYTES, b"clip %d of %d" % (i, n)) for i in range(SAMPLES)
        ]
        for n in range(SHARDS)
    }
    shards["part-03"].append(shards["part-00"][0])
    root = make_shards(tmp_path_factory.mktemp("ahead-src"), shards)
    last = root / f"part-{SHARDS - 1:02d}.tar"
    last.write_bytes(last.read_bytes()[: last.stat().st_size * 2 // 3])
    client = boto3.client("s3", endpoint_url=s3.direct)
    for tar in sorted(root.glob("*.tar")):
        client.put_object(Bucket=BUCKET, Key=f"src/{tar.name}", Body=tar.read_bytes())
    return root, f"s3://{BUCKET}/src"


def _plan(source: str, tmp_path: Path, name: str, cap: int | None = None) -> tuple[list[dict], dict[str, bytes]]:
    """The plan of `source` (its shards as plain dicts, without where each file is) and its spools' bytes (listing,
    records) by file name."""
    capped = {"max_samples_per_shard": cap} if cap is not None else {}
    cfg = config(Path("-"), Path("-"), tmp_path / f"out-{name}", source=f"vbvr:{source}", **capped)
    spool = tmp_path / name / "listing"
    plans = plan_shards(cfg, open_source(cfg.source, cfg.encoding), spool)
    where = ("path", "size", "mtime_ns", "version")
    shards = [{k: v for k, v in p.model_dump().items() if k not in where} for p in plans]
    for shard in shards:  # a damage names the tar where it is
        shard["damage"] = shard["damage"] and shard["damage"].rpartition(": ")[2]
    files = {f.name: f.read_bytes() for f in sorted(spool.iterdir())}
    records = listing.records(spool)
    files |= {f"records/{f.name}": f.read_bytes() for f in sorted(records.iterdir())} if records.is_dir() else {}
    return shards, files


@pytest.mark.parametrize("cap", [None, 2], ids=["whole", "capped"])
def test_a_store_source_lists_several_tars_at_once_into_the_plan_a_local_listing_makes(s3, corpus, tmp_path, cap):
    """With every request held `LATENCY_S`, the plan of the store's tars has several requests in flight (one with
    one listing at a time), and its shards and listing spool are those of the same tars on local disk: counts, the
    duplicate across shards refused in the later one, the damaged tar counted up to its damage, the cap."""
    root, url = corpus
    local, local_files = _plan(str(root), tmp_path, "local", cap)
    s3.proxy.latency = LATENCY_S
    try:
        s3.proxy.reset()
        at_once, files = _plan(url, tmp_path, "at-once", cap)
        most_at_once = s3.proxy.most_in_flight
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ahead, "AHEAD", 1)
            mp.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path / "another-machine"))
            s3.proxy.reset()
            one_by_one, one_files = _plan(url, tmp_path, "one-by-one", cap)
            most_one_by_one = s3.proxy.most_in_flight
    finally:
        s3.proxy.latency = 0.0
    assert at_once == one_by_one == local
    assert {n: b for n, b in files.items() if not n.startswith("records/")} == local_files
    assert files == one_files  # the records a shard task makes its samples from, too
    assert most_at_once >= 2 and most_one_by_one == 1, (most_at_once, most_one_by_one)
    counts = [s["samples"] for s in local]
    assert counts[:5] == ([SAMPLES] * 3 + [SAMPLES + 1, SAMPLES] if cap is None else [cap] * 5)
    assert 0 < counts[5] <= (cap or SAMPLES)
    if cap is None:
        key = local_key(root)
        assert local[3]["duplicates"] == {key: f"part-00/{key}"} and local[5]["damage"]


def local_key(root: Path) -> str:
    """The key of the first tar's first sample (listed again in the fourth tar)."""
    source = open_source(f"vbvr:{root}")
    return next(iter(source.samples(source.shards()[0]))).key


def _range_gets(s3) -> int:
    return s3.proxy.counts["GET_RANGE"]


def _range_gets_by_tar(s3) -> dict[str, int]:
    return dict(Counter(path.rpartition("/")[2] for kind, path in s3.proxy.requests if kind == "GET_RANGE"))


def kept_tar(entry: Path) -> str:
    """The tar name a kept listing is of (its first line)."""
    return json.loads(entry.read_text().partition("\n")[0])["url"].rpartition("/")[2]


def test_a_later_plan_makes_its_samples_from_the_kept_listing(s3, corpus, tmp_path, own_machine_cache):
    """A second plan of the same objects sends at most two range requests a tar (the tar opened, one record proven)
    and makes the same plan and spools; a tar rewritten since (a new ETag), or whose kept listing was cut short, is
    listed again; the damaged tar is never kept."""
    _, url = corpus
    s3.proxy.reset()
    first = _plan(url, tmp_path, "first")
    kept = sorted(own_machine_cache.joinpath(listing_cache.FOLDER).glob("*.jsonl"))
    assert len(kept) == SHARDS - 1  # every tar but the damaged one

    s3.proxy.reset()
    again = _plan(url, tmp_path, "again")
    assert again == first
    by_tar = _range_gets_by_tar(s3)
    damaged = f"part-{SHARDS - 1:02d}.tar"
    # opened, and one record picked at random proven (its header: `infra.sources.relist`); no listing of headers
    assert all(n <= 2 for tar, n in by_tar.items() if tar != damaged), by_tar
    assert by_tar[damaged] > 1, by_tar  # listed again (never kept): its headers read; bench/store_plan_bench.py: ratios

    kept[0].write_bytes(kept[0].read_bytes().rpartition(b"\n")[0].rpartition(b"\n")[0] + b"\n")  # a record lost
    client = boto3.client("s3", endpoint_url=s3.direct)
    body = client.get_object(Bucket=BUCKET, Key="src/part-01.tar")["Body"].read()
    client.put_object(Bucket=BUCKET, Key="src/part-01.tar", Body=body + bytes(1024))  # the same members, a new ETag
    s3.proxy.reset()
    third = _plan(url, tmp_path, "third")
    assert third == first
    by_tar = _range_gets_by_tar(s3)
    assert by_tar[kept_tar(kept[0])] > 1 and by_tar["part-01.tar"] > 1, by_tar  # their headers read again
    assert all(n <= 2 for tar, n in by_tar.items() if tar not in (kept_tar(kept[0]), "part-01.tar", damaged)), by_tar
    assert len(list(own_machine_cache.joinpath(listing_cache.FOLDER).glob("*.jsonl"))) == SHARDS  # the new one kept


def test_the_hubs_tars_are_listed_at_once_into_the_plan_a_local_listing_makes(hub_env, corpus, tmp_path, monkeypatch):
    """``vbvr:hf://datasets/...``: the Hub's file system, listing the tars on the plan's listing threads (several
    of them), makes the plan and listing spool of the same tars on local disk."""
    root, _ = corpus
    hub_env.create("org/ahead", private=True)
    hub_env.commit("org/ahead", {f"data/{tar.name}": tar.read_bytes() for tar in sorted(root.glob("*.tar"))})
    local, local_files = _plan(str(root), tmp_path, "local")
    threads: set[str] = set()
    list_shard = ahead.list_shard

    def on_its_thread(*args: object) -> ahead.Listed:
        threads.add(threading.current_thread().name)
        return list_shard(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ahead, "list_shard", on_its_thread)
    shards, files = _plan("hf://datasets/org/ahead@main/data", tmp_path, "hub")
    assert len(threads) >= 2 and all(name.startswith("plan-list") for name in threads), threads
    assert shards == local
    assert {n: b for n, b in files.items() if not n.startswith("records/")} == local_files
    resolved = {path for method, path in ((r.method, r.path) for r in hub_env.requests) if "/resolve/" in path}
    assert len(resolved) == SHARDS, resolved  # every tar read, each through its own resolve URL


def test_a_kept_listing_unused_for_a_month_is_removed(s3, corpus, tmp_path, own_machine_cache):
    """Each read of a kept listing marks it used; `prune` removes those unused for `UNUSED_DAYS`, not the others."""
    _, url = corpus
    _plan(url, tmp_path, "first")
    folder = own_machine_cache / listing_cache.FOLDER
    kept = sorted(folder.glob("*.jsonl"))
    month_ago = time.time() - (listing_cache.UNUSED_DAYS + 1) * 86400
    for entry in kept:
        os.utime(entry, (month_ago, month_ago))
    (shard,) = [s for s in open_source(f"vbvr:{url}").shards() if s.id == kept_tar(kept[0]).removesuffix(".tar")]
    assert listing_cache.cached(shard) is not None  # read: used now
    assert listing_cache.prune(folder) == len(kept) - 1
    assert sorted(folder.glob("*.jsonl")) == [kept[0]]
