"""Upload benchmark against a moto S3 server on 127.0.0.1, measured in the same run.

Baseline: one file at a time (workers=1). Ours: the default parallel transfers (workers=8), then an
unchanged rerun (list + compare, nothing sent) and the remote check. Prints seconds, MiB/s and the ratios.
Numbers are for the loopback store on this machine: they show the parallelism and the cost of a no-op
rerun relative to a first upload, not a real network's throughput.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from infra.config import UploadConfig
from infra.publish.base import LocalFile, parse_target
from infra.publish.s3 import S3Remote

SMALL, SMALL_MIB = 48, 1  # per-sample files
BIG, BIG_MIB = 3, 20  # over the multipart threshold (chunk 5 MiB)


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("moto server did not start")


def _files(root: Path) -> list[LocalFile]:
    rng = random.Random(0)
    files = []
    for i, mib in [(i, SMALL_MIB) for i in range(SMALL)] + [(SMALL + i, BIG_MIB) for i in range(BIG)]:
        data = rng.randbytes(mib << 20)
        path = root / f"g/{i:05d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append(LocalFile(f"g/{i:05d}.pt", len(data), hashlib.sha256(data).hexdigest(), "data", source=path))
    return files


def _timed(label: str, fn: Callable[[], object], total_mib: float | None = None) -> float:
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    rate = f"  {total_mib / seconds:7.1f} MiB/s" if total_mib else ""
    print(f"{label:<34} {seconds:7.2f} s{rate}")
    return seconds


def main() -> None:
    proc, url = _moto()
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    os.environ.update(AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    try:
        import boto3  # noqa: PLC0415

        boto3.client("s3").create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as tmp:
            files = _files(Path(tmp))
            total = sum(f.size for f in files) / (1 << 20)
            print(f"{len(files)} files, {total:.0f} MiB ({SMALL} × {SMALL_MIB} MiB, {BIG} × {BIG_MIB} MiB multipart)")
            results = {}
            for workers in (1, 8):
                remote = S3Remote(
                    parse_target(f"s3://bench/w{workers}"), UploadConfig(to="s3://bench/x", chunk_mb=5, workers=workers)
                )
                results[workers] = _timed(
                    f"first upload, workers={workers}",
                    lambda r=remote: r.send(files, replace={}, on_sent=lambda f: None),
                    total,
                )
            listed = _timed("unchanged rerun: list (HEAD each)", lambda: remote.list())
            print(f"parallel speed-up (workers 8 vs 1): {results[1] / results[8]:.2f}×")
            print(f"unchanged rerun vs first upload:     {listed / results[8]:.3f}× the time")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


if __name__ == "__main__":
    main()
