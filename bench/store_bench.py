"""Sources in an object store against the same files on local disk, measured in the same run.

A loopback S3 (moto's server on 127.0.0.1) behind the counting proxy of the tests (`tests/s3_proxy.py`) holds the
same clips as a local folder, as a VBVR tar shard and as a ``folder:`` tree. For each kind: the seconds to list the
source and read every sample's media and caption (best of `--repeats`), local and from S3, and their ratio; the
requests per sample the proxy counted (GET, ranged GET, HEAD, LIST; the times are taken straight at moto, without
the proxy); for the tar, the bytes a listing fetched
against the tar's size, and what a resumed shard (listed, nothing read) fetches.

The numbers are for a loopback store on this machine: they show the cost of the requests and of the client
library, not a real network's latency or bandwidth (a real store adds ~10-50 ms a request).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import boto3

from infra.demo.data import DemoSample, write_vbvr_tar
from infra.demo.testmedia import real_clip
from infra.sources import open_source
from tests.s3_proxy import loopback_s3

BUCKET = "lf-bench"
CLIPS = ("bikes", "carphone", "bigbuckbunny", "sample_1080p")


def _samples(count: int) -> list[DemoSample]:
    clips = [real_clip(name).read_bytes() for name in CLIPS]
    generator, task = "G-11_handle_object_reappearance_data-generator", "handle_object_reappearance"
    return [
        DemoSample(generator, task, i, {"ground_truth.mp4": clips[i % len(clips)], "prompt.txt": b"clip %d" % i})
        for i in range(count)
    ]


def _write(root: Path, samples: list[DemoSample]) -> tuple[Path, Path]:
    tar = write_vbvr_tar(root / "vbvr" / "part-00000.tar", samples)
    folder = root / "folder"
    for sample in samples:
        where = folder / sample.generator
        where.mkdir(parents=True, exist_ok=True)
        (where / f"{sample.index:05d}.mp4").write_bytes(sample.files["ground_truth.mp4"])
        (where / f"{sample.index:05d}.txt").write_bytes(sample.files["prompt.txt"])
    return tar.parent, folder


def _upload(client: object, local: Path, prefix: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes())


def read_all(spec: str) -> int:
    """List the source and read every sample's media and caption; the bytes read."""
    source = open_source(spec)
    total = 0
    for shard in source.shards():
        for ref in source.samples(shard):
            total += len(ref.read_media() or b"") + len(ref.read_prompt() or b"")
    return total


def list_only(spec: str) -> int:
    """A resumed shard whose samples are all done: listed, nothing read; the samples listed."""
    source = open_source(spec)
    return sum(1 for shard in source.shards() for _ in source.samples(shard))


def _aim(endpoint: str) -> None:
    """Point the sources' S3 client at `endpoint` (fsspec keeps one client per set of options: a new one)."""
    import s3fs  # noqa: PLC0415 - the store's library, as the sources import it

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    s3fs.S3FileSystem.clear_instance_cache()


def builds(vbvr: Path, root: Path, repeats: int) -> dict[str, float]:
    """Whole `latentforge build` runs (a fresh process each, one migrated Prefect home, the tiny Wan2.2 model at
    17×48×80 on the CPU) of the same clips from local disk and from the S3 (straight at moto): best wall seconds."""
    from infra.demo.tiny import make_tiny_wan22  # noqa: PLC0415 - only the build comparison needs a model

    model = make_tiny_wan22(root / "tiny-wan22", seed=0)
    home = root / "prefect-home"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    prefect, latentforge = (str(Path(sys.executable).with_name(n)) for n in ("prefect", "latentforge"))
    subprocess.run([prefect, "server", "database", "upgrade", "-y"], env=env, check=True, capture_output=True)
    flags = ["--model", str(model), "--frames", "17", "--height", "48", "--width", "80", "--device", "cpu"]
    flags += ["--dtype", "fp32", "--decode-samples", "0", "--on-loss", "accept", "--on-conflict", "abort"]
    seconds: dict[str, list[float]] = {"local": [], "s3": []}
    for attempt in range(repeats):
        for where, spec in (("local", f"vbvr:{vbvr}"), ("s3", f"vbvr:s3://{BUCKET}/vbvr")):
            out = root / f"out-{where}-{attempt}"
            start = time.perf_counter()
            run = subprocess.run([latentforge, "build", "--source", spec, "--out", str(out), *flags], env=env,
                                 capture_output=True, text=True)  # fmt: skip
            seconds[where].append(time.perf_counter() - start)
            if run.returncode != 0:
                raise RuntimeError(f"build from {where} failed: {run.stderr[-2000:]}")
    return {where: min(times) for where, times in seconds.items()}


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build", action="store_true", help="also whole builds, local against S3 (minutes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, loopback_s3(BUCKET, "bench", "bench", Path(tmp)) as store:
        proxy, direct = store.proxy, store.direct
        client = boto3.client("s3", endpoint_url=direct)
        samples = _samples(args.samples)
        vbvr, folder = _write(Path(tmp), samples)
        _upload(client, vbvr, "vbvr")
        _upload(client, folder, "folder")
        tar_bytes = (vbvr / "part-00000.tar").stat().st_size
        print(f"{args.samples} samples, {tar_bytes / 2**20:.1f} MiB of clips; best of {args.repeats}")
        print("| kind | local s | S3 s | local / S3 | S3 MiB/s | GET | ranged GET | HEAD | LIST (per sample) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for kind, local in (("vbvr", vbvr), ("folder", folder)):
            remote = f"{kind}:s3://{BUCKET}/{kind}"
            t_local = best(lambda spec=f"{kind}:{local}": read_all(spec), args.repeats)
            _aim(direct)  # timed straight at moto; counted through the proxy
            t_s3 = best(lambda spec=remote: read_all(spec), args.repeats)
            _aim(proxy.url)
            proxy.reset()
            read = read_all(remote)
            n = args.samples
            c = proxy.counts
            print(
                f"| {kind} | {t_local:.3f} | {t_s3:.3f} | {t_local / t_s3:.2f}× | {read / 2**20 / t_s3:.0f} | "
                f"{c['GET'] / n:.2f} | {c['GET_RANGE'] / n:.2f} | {c['HEAD'] / n:.2f} | {c['LIST'] / n:.2f} |"
            )
        proxy.reset()
        listed = list_only(f"vbvr:s3://{BUCKET}/vbvr")
        print(
            f"\nvbvr listing (a resumed shard, every sample done): {listed} samples, "
            f"{proxy.bytes_out / 2**10:.0f} KiB fetched of a {tar_bytes / 2**20:.1f} MiB tar "
            f"({proxy.bytes_out / tar_bytes:.2%}); requests: {dict(proxy.counts)}"
        )
        if args.build:
            _aim(direct)
            took = builds(vbvr, Path(tmp), max(1, args.repeats - 1))
            print(
                f"\nwhole builds, {args.samples} clips (start-up included): local {took['local']:.1f} s, "
                f"S3 {took['s3']:.1f} s: S3 at {took['local'] / took['s3']:.2f}× local"
            )


if __name__ == "__main__":
    main()
