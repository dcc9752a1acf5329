"""What hashing every file costs `latentforge verify`: a cache of N distinct `.pt` files (copies of one real done
sample of a finished `pt` cache, each its own file and ledger row), verified `--quick` (sizes, the few samples
loaded hashed) and in full (every file's sha256), each timed REPEAT times; and sha256's own speed here.

    python bench/content_bench.py demo/cache --files 10000       # demo/cache: any finished pt cache
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.cache import ledger  # noqa: E402
from infra.cache.cachedir import read_cache_json  # noqa: E402
from infra.config import CacheSpec  # noqa: E402
from infra.gates.verify import verify_out  # noqa: E402

PER_SHARD, REPEAT = 1000, 3
logger = logging.getLogger("content_bench")


def synthesise(built: Path, out: Path, files: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """OUT with `built`'s cache.json and `files` copies of its first done sample; (latent shape, text shape)."""
    row = next(r for rows in ledger.read_all(built).values() for r in rows.values() if r.status == "done")
    data = (built / str(row.path)).read_bytes()
    out.mkdir(parents=True)
    shutil.copy(built / "cache.json", out / "cache.json")
    for shard in range(-(-files // PER_SHARD)):
        rows = []
        for i in range(shard * PER_SHARD, min(files, (shard + 1) * PER_SHARD)):
            rel = f"g{shard:03d}/s{i:07d}.pt"
            (out / rel).parent.mkdir(exist_ok=True)
            (out / rel).write_bytes(data)
            rows.append(row.model_copy(update={"key": rel, "id": rel, "group": f"g{shard:03d}", "path": rel}))
        ledger.seal(out, f"bench-{shard:05d}", rows)
    record = torch.load(built / str(row.path), map_location="cpu", weights_only=True)
    return tuple(record["x0"].shape), tuple(record["text_embeds"].shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="a finished pt cache (one done sample is copied)")
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--scratch", type=Path, default=Path("demo/content-bench"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shutil.rmtree(args.scratch, ignore_errors=True)
    latent_shape, text_shape = synthesise(args.cache, args.scratch, args.files)
    spec = CacheSpec.model_validate(read_cache_json(args.scratch)["spec"])
    block = os.urandom(1 << 26)
    start = time.perf_counter()
    hashlib.sha256(block * 8).hexdigest()
    logger.info("sha256 on one core: %.0f MiB/s", 512 / (time.perf_counter() - start))
    for content in ("spot", "all"):
        for _ in range(REPEAT):
            start = time.perf_counter()
            report = verify_out(args.scratch, spec, latent_shape=latent_shape, text_shape=text_shape, content=content)
            logger.info(
                "verify %-4s %d files, %s bytes: %.2f s (%s)",
                "all" if content == "all" else "quick",
                report.done,
                f"{report.bytes:,}",
                time.perf_counter() - start,
                report.kind,
            )
    shutil.rmtree(args.scratch)


if __name__ == "__main__":
    main()
