"""Scale-out on Ray: shards per second with 1 and 2 Ray workers on this machine (decode-bound: real clips, the
tiny model), as a ratio, and an estimate of wall time and cost for 1M samples on 8 and 64 accelerators.

Each worker count gets its own local Ray cluster (1 or 2 CPUs); a warm-up build first loads the models into
its workers (as a long run would have them), then the timed build runs the demo data's 7 shards through
Prefect's RayTaskRunner. Prints the figures measured and the estimate's assumptions. Takes a few minutes.

    python bench/ray_bench.py [--frames 33 --size 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

import flows  # noqa: F401  (offline defaults before Prefect loads)
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.config import BuildConfig
from infra.demo.data import make_demo_data
from infra.demo.tiny import make_tiny_wan22
from infra.ops import runners

SAMPLES = 1_000_000
ACCELERATORS = (8, 64)
#: Assumptions of the estimate (change them here): the accelerator's encode time per sample at the Wan2.2 recipe
#: (33 × 832 × 832: VAE + UMT5, the issue's ~1 s figure), the CPU cores per accelerator feeding decode, and the
#: on-demand price per accelerator-hour.
ACCEL_SECONDS_PER_SAMPLE = 1.0
DECODE_CORES_PER_ACCEL = 8
PRICE_PER_ACCEL_HOUR = {"GPU (H100-class, $/h)": 3.00, "Trainium (trn1 chip, $/h)": 1.34}


def _build(data: Path, model: Path, out: Path, workers: int, frames: int, size: int) -> dict[str, Any]:
    cfg = BuildConfig(
        source=f"vbvr:{data}",
        model=str(model),
        out=str(out),
        frames=frames,
        height=size,
        width=size,
        device="cpu",
        dtype="fp32",
        workers=workers,
        runner="ray",
        on_conflict="abort",
        on_stale="abort",
        on_loss="accept",
        decode_samples=0,
    )
    ok, result = run_build(cfg)
    if not ok:
        raise SystemExit(f"build failed: {result}")
    return result


def _per_sample_seconds(out: Path) -> float:
    rows = [r for shard in ledger.read_all(out).values() for r in shard.values() if r.status == "done"]
    return sum(r.seconds for r in rows) / max(len(rows), 1)


def _measure(root: Path, data: Path, model: Path, workers: int, frames: int, size: int) -> dict[str, float]:
    """A local cluster of `workers` CPUs: a warm-up build, then the timed one."""
    env = runners.worker_env(None)
    env["PYTHONPATH"] = runners.CODE_ROOT
    ray.init(num_cpus=workers, include_dashboard=False, namespace=runners.NAMESPACE, runtime_env={"env_vars": env})
    try:
        _build(data, model, root / f"warm-{workers}", workers, frames, size)
        start = time.perf_counter()
        result = _build(data, model, root / f"out-{workers}", workers, frames, size)
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
    shards = len(list(data.glob("*.tar")))
    per_sample = _per_sample_seconds(root / f"out-{workers}")
    return {
        "workers": workers,
        "shards": shards,
        "samples": result["done"],
        "preprocess_s": result["seconds"],
        "build_wall_s": round(wall, 2),
        "shards_per_s": shards / result["seconds"],
        "sample_s": per_sample,
    }


def _estimate(sample_s: float, efficiency: float) -> list[str]:
    """1M samples on N accelerators, N tasks at once at the measured scaling efficiency. A sample's CPU time
    (decode + resize, measured here on one core; the tiny model's encode is included, so it is an upper bound)
    and its accelerator encode (assumed) run one after the other in a task (as built), or, not built here,
    overlapped, with decode spread over the host's cores while the accelerator encodes."""
    scenarios = {
        "as built (decode, then encode, in each task)": sample_s + ACCEL_SECONDS_PER_SAMPLE,
        f"if decode were overlapped on {DECODE_CORES_PER_ACCEL} cores per accelerator (not built)": max(
            ACCEL_SECONDS_PER_SAMPLE, sample_s / DECODE_CORES_PER_ACCEL
        ),
    }
    lines = [
        f"assumed: {ACCEL_SECONDS_PER_SAMPLE:.2f} s accelerator encode per sample (Wan2.2, 33x832x832); measured: "
        f"{sample_s:.3f} s CPU per sample on one core here; scaling efficiency {efficiency:.2f} (1 -> 2 workers)"
    ]
    for label, per_sample in scenarios.items():
        lines.append(f"{label}: {per_sample:.3f} s per sample per accelerator")
        for n in ACCELERATORS:
            hours = SAMPLES * per_sample / (n * efficiency) / 3600
            costs = ", ".join(f"{name} {n * hours * price:,.0f} $" for name, price in PRICE_PER_ACCEL_HOUR.items())
            lines.append(f"  1M samples on {n:>2} accelerators: {hours:7.1f} h wall; cost {costs}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lf-ray-bench-") as tmp:
        root = Path(tmp)
        data = root / "data"
        make_demo_data(data, n_shards=7, with_bad_sample=False)  # 7 shards of one real clip each
        model = make_tiny_wan22(root / "model", seed=0)
        one = _measure(root, data, model, 1, args.frames, args.size)
        two = _measure(root, data, model, 2, args.frames, args.size)
    for m in (one, two):
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()}))
    ratio = two["shards_per_s"] / one["shards_per_s"]
    print(f"shards/s: 1 worker {one['shards_per_s']:.3f}, 2 workers {two['shards_per_s']:.3f}; ratio {ratio:.2f}x")
    for line in _estimate(one["sample_s"], min(1.0, ratio / 2)):
        print(line)


if __name__ == "__main__":
    main()
