"""Decode-only clips/s of the read-ahead's decoders, threads against processes (``python bench/decode_bench.py
--pool``; the docstring there says what is measured)."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.feed_bench import CLIP_NAMES, make_source  # noqa: E402
from bench.feed_family import make_model  # noqa: E402
from infra.config import BuildConfig  # noqa: E402
from infra.plan import BuildPlan, make_plan  # noqa: E402
from infra.preprocess.decoders import PoolKind, decoders  # noqa: E402
from infra.preprocess.read import read  # noqa: E402
from infra.sources import open_source  # noqa: E402

logger = logging.getLogger("decode_pool_bench")
FAMILY = "bench.feed_family:FeedFamily"


def _plan(src: Path, root: Path, frames: int, size: int) -> BuildPlan:
    model = make_model(root / "model", 0.0, root / "busy.log")
    cfg = BuildConfig(source=f"vbvr:{src}", model=str(model), out=str(root / "out"), family=FAMILY, frames=frames,
                      height=size, width=size, device="cpu", dtype="fp32")  # fmt: skip
    return make_plan(cfg)


def _cpu() -> tuple[float, float]:
    """CPU seconds so far of this process (all its threads) and of its live children (the decoder processes)."""
    children = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        children += times.user + times.system
    return time.process_time(), children


def _touch(pixels: torch.Tensor) -> int:
    """Read one value of every page of the pixels here (as the encoder will: pixels mapped from a decoder process's
    shared memory are paged in on first touch, a cost of this process)."""
    float(pixels.reshape(-1)[:: 4096 // pixels.element_size()].sum())
    return pixels.nbytes


def _pass(plan: BuildPlan, pool, clips: int, workers: int) -> tuple[float, float, float]:
    """Wall seconds to read `clips` clips here and prepare them on `pool` (at most 2 × workers in flight), and the
    CPU seconds of this process and of the decoder processes meanwhile."""
    source = open_source(plan.config.source)
    flying: deque[Future] = deque()
    got = 0
    cpu = _cpu()
    start = time.perf_counter()
    for ref in itertools.islice(source.samples(plan.shards[0].shard), clips):
        if len(flying) >= 2 * workers:
            got += flying.popleft().result().video.pixels.nbytes
        flying.append(pool.submit(read(ref)))
    while flying:
        got += flying.popleft().result().video.pixels.nbytes
    seconds, after = time.perf_counter() - start, _cpu()
    return seconds, after[0] - cpu[0], after[1] - cpu[1]


def measure(plan: BuildPlan, kind: PoolKind, workers: int, clips: int, repeat: int) -> dict:
    """Start-up (pool made to first pixels of a warm-up pass over the distinct clips) and clips/s per repeat."""
    start = time.perf_counter()
    pool = decoders(kind, workers, plan.job)
    try:
        _pass(plan, pool, min(clips, len(CLIP_NAMES) * workers), workers)  # every worker started and warmed
        warm = time.perf_counter() - start
        rates, here, there = [], [], []
        for _ in range(repeat):
            seconds, own, children = _pass(plan, pool, clips, workers)
            rates.append(clips / seconds)
            here.append(own / clips)
            there.append(children / clips)
    finally:
        pool.shutdown()
    return {"kind": kind, "workers": workers, "rates": rates, "warm_s": warm, "here": min(here), "there": min(there)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kinds", nargs="+", default=["thread", "process"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory(prefix="decode-pool-") as tmp:
        root = Path(tmp)
        src = make_source(root, args.clips)
        plan = _plan(src, root, args.frames, args.size)
        rows = []
        for kind in args.kinds:
            for workers in args.workers:
                rows.append(measure(plan, kind, workers, args.clips, args.repeat))
                logger.info("%s", rows[-1])
    load += f" → {os.getloadavg()[0]:.1f}"
    base = max(rows[0]["rates"])
    logger.info(
        "\ndecode-only, %d real clips a pass (%s cycled), %dx%d², %s CPUs (shared; load %s), best of %d\n"
        "%-8s %7s %20s %8s %13s %13s %8s",
        args.clips, ", ".join(CLIP_NAMES), args.frames, args.size, os.cpu_count(), load, args.repeat,
        "decoders", "workers", "clips/s (each pass)", f"vs {rows[0]['kind']}×{rows[0]['workers']}",
        "CPU s/clip here", "in decoders", "start s",
    )  # fmt: skip
    for row in rows:
        each = ", ".join(f"{r:.2f}" for r in row["rates"])
        logger.info("%-8s %7d %20s %7.2fx %15.3f %13.3f %8.1f", row["kind"], row["workers"], each,
                    max(row["rates"]) / base, row["here"], row["there"], row["warm_s"])  # fmt: skip


if __name__ == "__main__":
    main()
