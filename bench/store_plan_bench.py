"""The plan of a source of many tars in a store (issue 40): seconds before the first sample can start, in one run —
the tars listed one after the other (``AHEAD = 1``: the listing before this work) against several at once (the
default), and a later plan of the same objects from this machine's kept listings — with every request held
`--latency` seconds by the counting proxy (a far store's round trip), and the requests each sent. The plans' shards
and spools are compared: they must be equal.

``--folder N``: the plan of a ``folder:`` source of N small objects under one prefix in the store (what a LIST of
10^4 keys costs), against the same files on local disk.

The tars hold placeholder members (the plan reads headers, never a member's bytes): `--samples` a tar, each member
over the stream's read-ahead so that each header is a range request of its own, as with real clips.

    PYTHONPATH=. python bench/store_plan_bench.py [--shards 16 --samples 16 --latency 0.03 --repeats 2]
    PYTHONPATH=. python bench/store_plan_bench.py --folder 10000 --latency 0.03
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3

import flows  # noqa: F401  (offline defaults before Prefect loads)
from infra.cache import listing
from infra.config import BuildConfig
from infra.demo.data import DemoSample, write_vbvr_tar
from infra.plan import plan_shards
from infra.sources import ahead, open_source
from tests.s3_proxy import LoopbackS3, loopback_s3

BUCKET = "lf-plan-bench"
GENERATOR = "G-11_handle_object_reappearance_data-generator"
MEMBER_BYTES = 40_000


def _tars(root: Path, shards: int, samples: int) -> Path:
    for s in range(shards):
        rows = [
            DemoSample(GENERATOR, "handle_object_reappearance", s * samples + i,
                       {"ground_truth.mp4": bytes([i % 251]) * MEMBER_BYTES, "prompt.txt": b"clip %d" % i})
            for i in range(samples)
        ]  # fmt: skip
        write_vbvr_tar(root / f"part-{s:05d}.tar", rows)
    return root


def _folder(root: Path, files: int) -> Path:
    for i in range(files):
        (root / f"clip-{i:06d}.mp4").write_bytes(b"not decoded by a plan %d" % i)
    return root


def _upload(store: LoopbackS3, root: Path, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=store.direct)
    for path in sorted(root.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


@contextlib.contextmanager
def _machine_cache(path: Path) -> Iterator[None]:
    saved = os.environ.get("LATENTFORGE_CACHE_DIR")
    os.environ["LATENTFORGE_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        os.environ.pop("LATENTFORGE_CACHE_DIR", None) if saved is None else os.environ.update(
            LATENTFORGE_CACHE_DIR=saved
        )


def _plan(source: str, work: Path, name: str) -> tuple[float, list[dict[str, Any]], dict[str, bytes]]:
    """(seconds, shards without where each file is, the spools' bytes) of a plan of `source`."""
    cfg = BuildConfig(source=source, model="-", out=str(work / f"out-{name}"))
    spool = work / name / "listing"
    start = time.perf_counter()
    plans = plan_shards(cfg, open_source(cfg.source, cfg.encoding), spool)
    seconds = time.perf_counter() - start
    where = ("path", "size", "mtime_ns", "version", "damage")
    shards = [{k: v for k, v in p.model_dump().items() if k not in where} for p in plans]
    files = {f.name: f.read_bytes() for f in sorted(spool.iterdir())} if spool.is_dir() else {}
    records = listing.records(spool)
    files |= {f"records/{f.name}": f.read_bytes() for f in sorted(records.iterdir())} if records.is_dir() else {}
    return seconds, shards, files


def _measured(store: LoopbackS3, source: str, work: Path, name: str) -> dict[str, Any]:
    store.proxy.reset()
    seconds, shards, files = _plan(source, work, name)
    requests = sum(store.proxy.counts.values())
    return {"seconds": seconds, "shards": shards, "files": files, "requests": requests,
            "most_in_flight": store.proxy.most_in_flight, "lists": store.proxy.counts["LIST"]}  # fmt: skip


def _tars_bench(store: LoopbackS3, work: Path, args: argparse.Namespace) -> None:
    url = f"s3://{BUCKET}/tars"
    _upload(store, _tars(work / "tars", args.shards, args.samples), "tars")
    best: dict[str, dict[str, Any]] = {}
    for repeat in range(args.repeats):
        runs = {}
        with _machine_cache(work / f"cache-{repeat}-one"):
            saved, ahead.AHEAD = ahead.AHEAD, 1
            try:
                runs["one after the other"] = _measured(store, f"vbvr:{url}", work, f"one-{repeat}")
            finally:
                ahead.AHEAD = saved
        with _machine_cache(work / f"cache-{repeat}-at-once"):
            runs[f"{ahead.AHEAD} at once"] = _measured(store, f"vbvr:{url}", work, f"at-once-{repeat}")
            runs["later plan (kept)"] = _measured(store, f"vbvr:{url}", work, f"kept-{repeat}")
        for name, run in runs.items():
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    first = next(iter(best.values()))
    equal = all(run["shards"] == first["shards"] and run["files"] == first["files"] for run in best.values())
    base = best["one after the other"]["seconds"]
    print(f"plan of {args.shards} tars × {args.samples} samples in a loopback S3, {args.latency * 1000:.0f} ms a "
          f"request, best of {args.repeats}:")  # fmt: skip
    print(f"{'listing':<22} {'seconds':>8} {'speed-up':>9} {'requests':>9} {'most at once':>13}")
    for name, run in best.items():
        print(f"{name:<22} {run['seconds']:>8.2f} {base / run['seconds']:>8.2f}× {run['requests']:>9} "
              f"{run['most_in_flight']:>13}")  # fmt: skip
    print(f"plans and spools equal: {equal}")


def _folder_bench(store: LoopbackS3, work: Path, args: argparse.Namespace) -> None:
    root = _folder(work / "folder", args.folder)
    _upload(store, root, "folder")
    local_s, local_shards, _ = _plan(f"folder:{root}", work, "local")
    run = _measured(store, f"folder:s3://{BUCKET}/folder", work, "store")
    print(f"plan of a folder: of {args.folder} objects, {args.latency * 1000:.0f} ms a request")
    print(f"local disk {local_s:.2f} s; the store {run['seconds']:.2f} s, {run['requests']} requests "
          f"({run['lists']} LIST); samples {sum(s['samples'] for s in run['shards'])} "
          f"(local {sum(s['samples'] for s in local_shards)})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--folder", type=int, default=0, help="plan a folder: source of N objects instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lf-plan-bench-") as tmp:
        work = Path(tmp)
        for folder in ("tars", "folder"):
            (work / folder).mkdir()
        # moto in its own process (its CPU is not the plan's); the uploads go to moto directly, past the proxy
        with loopback_s3(BUCKET, "AKIDPLANBENCH", "plan-bench-secret", work, moto="process") as store:
            store.proxy.latency = args.latency
            (_folder_bench if args.folder else _tars_bench)(store, work, args)


if __name__ == "__main__":
    main()
