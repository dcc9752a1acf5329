"""A whole build with its source (and OUT, `--out s3`) on a loopback S3 against the same build on local disk, in one
run: samples/s of the preprocess (the run's `seconds`: plan and start-up left out) and of its steady state (the
samples written while every shard thread was encoding, from the shard loop's `write` spans: `steady_rate`), and their
ratios (goal: a steady state ≥ 0.9× local), and the requests the S3 build sent, per sample, as the counting proxy of
the tests saw them (`tests/s3_proxy.py`: GET, ranged GET, HEAD, LIST, PUT; goal ≤ 3 PUTs a sample plus a constant a
shard), and those of a resume of that build (run again, nothing left to encode: goal ≤ 2 a sample plus a constant a
shard).

The loopback store is not free: moto (and the counting proxy, a thread of this process) spend CPU on this machine's
cores while the S3 build encodes, which a real store's client never pays. With ``--moto process`` (the default) moto
runs in its own process and the CPU seconds it and the proxy spent during each S3 build are printed beside that
build's wall time; the ratio above counts them in (it is what this machine saw, not a discounted figure).

The same clips, VBVR tars of `--shards` shards, the tiny Wan2.2 model at 17×48×80 on the CPU, the local runner with
2 workers; each build is done `--repeats` times into a fresh OUT (best time kept, requests of the last). The sample
files of the two builds are compared byte for byte. A loopback store shows what the requests and the client library
cost, not a network's latency (a real store adds ~10-50 ms a request).

    python bench/store_build_bench.py [--samples 24 --shards 2 --repeats 2 --out s3|local --moto process|thread
                                       --latency S --put-latency S --frames F --height H --width W]

``--latency S`` holds every request S seconds in the proxy (a far store's round trip).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import boto3

import flows  # noqa: F401  (offline defaults before Prefect loads)
from flows.terminal_run import run_build
from infra.config import BuildConfig
from infra.demo.data import DemoSample, write_vbvr_tar
from infra.demo.testmedia import real_clip
from infra.demo.tiny import make_tiny_wan22
from infra.preprocess.timing import ENV, read_timings
from tests.conftest import tree_files
from tests.s3_proxy import loopback_s3

BUCKET = "lf-build-bench"
CLIPS = ("bikes", "carphone", "bigbuckbunny")
GENERATOR = "G-11_handle_object_reappearance_data-generator"
KINDS = ("GET", "GET_RANGE", "HEAD", "LIST", "PUT")


def _shards(root: Path, samples: int, shards: int) -> Path:
    clips = [real_clip(name).read_bytes() for name in CLIPS]
    for s in range(shards):
        rows = [
            DemoSample(
                GENERATOR,
                "handle_object_reappearance",
                i,
                {"ground_truth.mp4": clips[i % len(clips)], "prompt.txt": b"clip %d" % i},
            )
            for i in range(s, samples, shards)
        ]
        write_vbvr_tar(root / f"part-{s:05d}.tar", rows)
    return root


GEOMETRY = {"frames": 17, "height": 48, "width": 80}


def _config(source: str, model: Path, out: str) -> BuildConfig:
    return BuildConfig(source=source, model=str(model), out=out, **GEOMETRY, device="cpu", dtype="fp32", workers=2,
                       on_conflict="abort", on_stale="abort", on_loss="accept", decode_samples=0)  # fmt: skip


def _build(source: str, model: Path, out: str, timing: Path | None = None) -> dict[str, Any]:
    """The build's result; with `timing`, the shard loop's spans recorded there (`infra.preprocess.timing`)."""
    if timing is not None:
        os.environ[ENV] = str(timing)
    try:
        ok, result = run_build(_config(source, model, out))
    finally:
        os.environ.pop(ENV, None)
    if not ok:
        raise SystemExit(f"build of {source} into {out} failed: {result}")
    return result


def steady_rate(timing: Path) -> float:
    """Samples written a second while every shard thread was encoding: the writes (`write` spans) that end between
    the last first write of any shard thread and the first last write of one, over that window's length. The start
    of each shard (its plan check, verify-existing, its first read) and the tail (one thread left) are left out."""
    ends: dict[tuple[int, str], list[float]] = {}
    for span in read_timings(timing):
        if span["stage"] == "write":
            ends.setdefault((span["pid"], span.get("thread", "")), []).append(span["end"])
    if len(ends) < 2:
        raise SystemExit(f"{timing}: write spans of {len(ends)} shard thread(s); the steady state needs 2")
    begin, end = max(min(e) for e in ends.values()), min(max(e) for e in ends.values())
    written = sum(begin < t <= end for times in ends.values() for t in times)
    return written / (end - begin) if end > begin else float("nan")


def _samples(files: dict[str, bytes]) -> dict[str, str]:
    """sha256 of each sample file (``.pt``) of a cache's files (relative path → bytes)."""
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items() if rel.endswith(".pt")}


def _pattern(path: str) -> str:
    """A request's path with its numbers and sample names folded (``.../00000012.pt`` → ``.../N.pt``) and its query
    reduced to its keys: requests of one kind for each sample count as one pattern."""
    where, _, query = path.partition("?")
    where = re.sub(r"[^/]*\d[^/]*(?=\.\w+$)|\d+", "N", unquote(where))
    keys = sorted({pair.partition("=")[0] for pair in query.split("&") if pair})
    return where + ("?" + "&".join(keys) if keys else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", choices=("s3", "local"), default="s3", help="where the S3 build's OUT is")
    parser.add_argument("--moto", choices=("process", "thread"), default="process", help="where moto's server runs")
    parser.add_argument("--put-latency", type=float, default=0.0, help="seconds the proxy holds each PUT (a far store)")
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds the proxy holds every request (a far store)"
    )
    for name, value in GEOMETRY.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--by-path", action="store_true", help="the resume's requests by kind and path pattern")
    args = parser.parse_args()
    GEOMETRY.update(frames=args.frames, height=args.height, width=args.width)
    with (
        tempfile.TemporaryDirectory() as tmp,
        loopback_s3(BUCKET, "bench", "bench", Path(tmp), moto=args.moto) as store,
    ):
        proxy, client = store.proxy, boto3.client("s3", endpoint_url=store.direct)
        proxy.put_delay, proxy.put_delay_match = args.put_latency, ""  # every PUT through the proxy ("" matches all)
        proxy.latency = args.latency
        root = Path(tmp)
        src = _shards(root / "src", args.samples, args.shards)
        for tar in sorted(src.glob("*.tar")):
            client.put_object(Bucket=BUCKET, Key=f"src/{tar.name}", Body=tar.read_bytes())
        model = make_tiny_wan22(root / "tiny-wan22", seed=0)
        _build(f"vbvr:{src}", model, str(root / "warm"))  # imports and first loads, outside the timed runs
        seconds: dict[str, list[float]] = {"local": [], "s3": []}
        steady: dict[str, list[float]] = {"local": [], "s3": []}
        loads: list[tuple[float, float, float | None, float]] = []  # each S3 build: wall, proxy CPU, moto CPU, ours
        local_cpu: list[float] = []  # each local build's process CPU seconds
        for attempt in range(args.repeats):
            local_out = root / f"local-{attempt}"
            ours_before = time.process_time()
            seconds["local"].append(
                _build(f"vbvr:{src}", model, str(local_out), root / f"t-local-{attempt}")["seconds"]
            )
            steady["local"].append(steady_rate(root / f"t-local-{attempt}"))
            local_cpu.append(time.process_time() - ours_before)
            s3_out = f"s3://{BUCKET}/out-{attempt}" if args.out == "s3" else str(root / f"s3src-{attempt}")
            proxy.reset()
            moto_before, ours_before, wall = store.moto_cpu_seconds(), time.process_time(), time.perf_counter()
            seconds["s3"].append(_build(f"vbvr:s3://{BUCKET}/src", model, s3_out, root / f"t-s3-{attempt}")["seconds"])
            steady["s3"].append(steady_rate(root / f"t-s3-{attempt}"))
            wall, ours = time.perf_counter() - wall, time.process_time() - ours_before
            moto = store.moto_cpu_seconds()
            loads.append((wall, proxy.cpu_seconds, None if moto is None else moto - (moto_before or 0.0), ours))
            counts = dict(proxy.counts)
        proxy.reset()
        _build(f"vbvr:s3://{BUCKET}/src", model, s3_out)  # the same build again: a resume with nothing to encode
        resumed = dict(proxy.counts)
        on_source = Counter(kind for kind, path in proxy.requests if f"/{BUCKET}/src" in path)
        by_path = Counter((kind, _pattern(path)) for kind, path in proxy.requests)
        if args.out == "s3":
            same = _samples(store.objects(BUCKET, f"out-{args.repeats - 1}")) == _samples(tree_files(local_out))
        else:
            same = _samples(tree_files(Path(s3_out))) == _samples(tree_files(local_out))
        n = args.samples
        best = {where: min(times) for where, times in seconds.items()}
        rate = {where: n / s for where, s in best.items()}
        held = max(steady["local"]), max(steady["s3"])
        print(
            f"{n} samples in {args.shards} shards at {args.frames}×{args.height}×{args.width}; source on S3, OUT "
            f"{args.out}; best of {args.repeats}; {args.latency:g} s every request, {args.put_latency:g} s more a PUT"
        )
        print("| build | preprocess s | samples/s | vs local | steady samples/s | steady vs local |")
        print("|---|---|---|---|---|---|")
        print(f"| local → local | {best['local']:.2f} | {rate['local']:.2f} | 1.00× | {held[0]:.2f} | 1.00× |")
        print(f"| S3 → {args.out} | {best['s3']:.2f} | {rate['s3']:.2f} | {rate['s3'] / rate['local']:.2f}× "
              f"| {held[1]:.2f} | {held[1] / held[0]:.2f}× |")  # fmt: skip
        print(f"steady state of each run (samples/s): local {steady['local']}, S3 {steady['s3']}")
        print(f"\nthe loopback store's own CPU during each S3 build (moto: {args.moto}; this machine's cores compete):")
        print("| build wall s | moto CPU s | proxy CPU s (a thread of the build's process) | build process CPU s |")
        print("|---|---|---|---|")
        for wall, proxy_cpu, moto_cpu, ours in loads:
            shown = "n/a (a thread of the build's process)" if moto_cpu is None else f"{moto_cpu:.2f}"
            print(f"| {wall:.2f} | {shown} | {proxy_cpu:.2f} | {ours:.2f} |")
        shown_cpu = ", ".join(f"{c:.2f}" for c in local_cpu)
        print(f"the local builds' process CPU s (the same work without a store): {shown_cpu}")
        print("\nrequests of the S3 build, per sample (and in all):")
        print("| " + " | ".join(KINDS) + " |\n|" + "---|" * len(KINDS))
        print("| " + " | ".join(f"{counts.get(k, 0) / n:.2f} ({counts.get(k, 0)})" for k in KINDS) + " |")
        puts = counts.get("PUT", 0)
        print(f"PUTs beyond 3 a sample, per shard: {(puts - 3 * n) / args.shards:.1f}; other: {counts}")
        print("\nrequests of its resume (the same build again), per sample (and in all):")
        print("| " + " | ".join(KINDS) + " | all |\n|" + "---|" * (len(KINDS) + 1))
        every = sum(resumed.values())
        print("| " + " | ".join(f"{resumed.get(k, 0) / n:.2f} ({resumed.get(k, 0)})" for k in KINDS), end="")
        print(f" | {every / n:.2f} ({every}) |; other: {resumed}")
        print(f"of which on the source's objects (the rest: OUT's): {dict(on_source)}")
        if args.by_path:
            for (kind, pattern), count in by_path.most_common():
                print(f"  {count:>5} {kind:<9} {pattern}")
        print(f"sample files byte for byte equal to the local build's: {same}")


if __name__ == "__main__":
    main()
