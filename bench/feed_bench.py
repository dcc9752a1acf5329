"""The feed, measured without a GPU: is the encoder kept busy by the real pipeline around it?

`latentforge build` runs as a user runs it (a fresh process, the embedded Prefect API, every gate): real clips
from the test-media cache (`infra.demo.testmedia`: 176×144 to 1920×1080, 23 to 250 frames) in one VBVR shard,
read from the tar, decoded by PyAV, sampled to 33 frames and resized, written with the journal and ledger. The
encoder is the bench-only family `bench.feed_family` (``--family bench.feed_family:FeedFamily``): a fixed latency
per clip spent in ``time.sleep``, which releases the GIL as an accelerator call does, its busy intervals logged.

Reported per latency × ``--decode-workers``: the encoder's busy fraction over the steady state (from the end of the
shard's first encode to the end of its last; start-up, the one-sample sanity and the first decode left out), the
steady samples/s, and whether the decoders could keep up at all: decode-only clips/s with that many threads
(read + decode + sample + resize, no encoder; measured here, in-process, on the same clips) against the encoder's
demand (1/latency). Target: ≥ 95% busy wherever that capacity exceeds the demand (PASS / MISS); elsewhere the
decoders set the pace and the row says ``decode-bound``.

    python bench/feed_bench.py              # quick: 8 clips per build, 8 builds (a few minutes on 2 cores)
    python bench/feed_bench.py --clips 24   # a longer steady state
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.feed_family import busy_fraction, make_model, read_intervals  # noqa: E402
from bench.throughput_bench import migrated_home  # noqa: E402

FAMILY = "bench.feed_family:FeedFamily"
CLIP_NAMES = ("bigbuckbunny", "bikes", "carphone", "sample_1080p")
GENERATOR = "G-11_handle_object_reappearance_data-generator"
FRAMES, SIZE = 33, 256
LATENCIES = (0.25, 0.5, 1.0, 2.0)
DECODE_WORKERS = (1, 2)
TARGET = 0.95

logger = logging.getLogger("feed_bench")


def make_source(root: Path, clips: int) -> Path:
    """One VBVR shard of `clips` real clips, cycled."""
    from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: PLC0415 - demo material: the bench's workload
    from infra.demo.testmedia import real_clip  # noqa: PLC0415 - demo material: the bench's workload

    data = [real_clip(name).read_bytes() for name in CLIP_NAMES]
    task = GENERATOR.split("_", 1)[1].removesuffix("_data-generator")
    samples = [
        DemoSample(generator=GENERATOR, task=task, index=i, files={"ground_truth.mp4": data[i % len(data)],
                                                                   "prompt.txt": f"clip {i}".encode()})
        for i in range(clips)
    ]  # fmt: skip
    src = root / "src"
    src.mkdir(parents=True)
    write_vbvr_tar(src / "feed_part-00000.tar", samples)
    return src


def build_args(src: Path, model: Path, out: Path, decode_workers: int, frames: int, size: int) -> list[str]:
    """The `latentforge build` command line of one measured run (one shard task at a time: one encoder)."""
    return [
        *("build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--family", FAMILY),
        *("--frames", str(frames), "--height", str(size), "--width", str(size), "--device", "cpu", "--dtype", "fp32"),
        *("--workers", "1", "--decode-workers", str(decode_workers)),
        *("--decode-samples", "0", "--on-loss", "accept", "--on-conflict", "abort"),
    ]


def decode_rate(src: Path, model: Path, workers: int, frames: int, size: int) -> float:
    """Decode-only clips/s with `workers` threads: each clip read on this thread, prepared (decode, sample, resize)
    in the pool, as the shard's read-ahead does; no encoder."""
    from infra.config import BuildConfig  # noqa: PLC0415 - heavy: the pipeline, after the workload is made
    from infra.plan import make_plan  # noqa: PLC0415 - heavy: the pipeline
    from infra.preprocess.prepare import prepare  # noqa: PLC0415 - heavy: the pipeline
    from infra.preprocess.read import read  # noqa: PLC0415 - heavy: the pipeline
    from infra.sources import open_source  # noqa: PLC0415 - heavy: the pipeline

    with tempfile.TemporaryDirectory() as tmp:
        cfg = BuildConfig(source=f"vbvr:{src}", model=str(model), out=str(Path(tmp) / "out"), family=FAMILY,
                          frames=frames, height=size, width=size, device="cpu", dtype="fp32")  # fmt: skip
        plan = make_plan(cfg)
        source = open_source(cfg.source)
        for shard in plan.shards[:1]:  # warm-up, untimed: the first decode's imports and allocations
            for ref in itertools.islice(source.samples(shard.shard), len(CLIP_NAMES)):
                prepare(read(ref), plan.job)
        start = time.perf_counter()
        count = 0
        with ThreadPoolExecutor(workers) as pool:
            pending = []
            for shard in plan.shards:
                for ref in source.samples(shard.shard):
                    pending.append(pool.submit(prepare, read(ref), plan))
                    count += 1
            for future in pending:
                future.result()
        return count / (time.perf_counter() - start)


def measure(
    root: Path, src: Path, clips: int, latency: float, workers: int, home: Path, frames: int, size: int
) -> dict:
    """One `latentforge build` with the stand-in encoder: busy fraction and steady samples/s of its shard."""
    name = f"lat{latency:g}-w{workers}"
    log = root / f"{name}.busy"
    model = make_model(root / f"model-{name}", latency, log)
    out = root / f"out-{name}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT),
           os.environ.get("PYTHONPATH"))))}  # fmt: skip
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a busy 2-core machine
    command = [sys.executable, "-m", "flows.cli", *build_args(src, model, out, workers, frames, size)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name}: build exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    shard = read_intervals(log)[-clips:]  # the shard's encodes; the one-sample sanity's came before them
    window = shard[-1][1] - shard[0][1]
    return {"latency": latency, "workers": workers, "busy": busy_fraction(shard),
            "rate": (len(shard) - 1) / window, "seconds": seconds}  # fmt: skip


def verdict(busy: float, capacity: float, demand: float) -> str:
    if capacity <= demand:
        return f"decode-bound (at most {capacity / demand:.0%})"
    return "PASS" if busy >= TARGET else "MISS"


def table(rows: list[dict], capacity: dict[int, float]) -> str:
    lines = [
        f"{'latency s':>9} {'decode workers':>14} {'decode clips/s':>14} {'demand clips/s':>14} "
        f"{'busy':>6} {'steady clips/s':>14} {'run s':>6}  target ≥ {TARGET:.0%} busy where decode > demand",
    ]
    for row in rows:
        cap, demand = capacity[row["workers"]], 1 / row["latency"]
        lines.append(
            f"{row['latency']:>9g} {row['workers']:>14} {cap:>14.2f} {demand:>14.2f} {row['busy']:>6.1%} "
            f"{row['rate']:>14.2f} {row['seconds']:>6.1f}  {verdict(row['busy'], cap, demand)}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=8, help="clips per build (the steady state is clips - 1)")
    parser.add_argument("--latencies", type=float, nargs="+", default=list(LATENCIES))
    parser.add_argument("--decode-workers", type=int, nargs="+", default=list(DECODE_WORKERS))
    parser.add_argument("--frames", type=int, default=FRAMES)
    parser.add_argument("--size", type=int, default=SIZE)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="feed-bench-") as tmp:
        root = Path(tmp)
        src = make_source(root, args.clips)
        home = migrated_home(root / "prefect-home")
        probe = make_model(root / "model-probe", 0.0, root / "probe.busy")
        capacity = {w: decode_rate(src, probe, w, args.frames, args.size) for w in args.decode_workers}
        logger.info("decode-only clips/s: %s", {w: round(r, 2) for w, r in capacity.items()})
        rows = []
        for latency in args.latencies:
            for workers in args.decode_workers:
                rows.append(measure(root, src, args.clips, latency, workers, home, args.frames, args.size))
                logger.info("%s", rows[-1])
    where = (
        f"{args.clips} real clips ({', '.join(CLIP_NAMES)} cycled), {args.frames}x{args.size}², {os.cpu_count()} CPUs"
    )
    logger.info(
        "\nfeed: the stand-in encoder's busy fraction over the steady state; %s\n%s", where, table(rows, capacity)
    )
    if args.json:
        args.json.write_text(json.dumps({"capacity": capacity, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
