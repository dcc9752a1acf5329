"""Memory options and video batching: peak RSS and seconds of one shard, each option against a baseline, same run.

Workload: real clips from the test-media cache cycled into one VBVR shard, at 17×832² by default (fp32, CPU): wider
than the Wan2.2 VAE's tile (512 pixels: 256 after its 2×2 patchify), so ``--vae-tiling`` tiles. The model is the tiny
Wan2.2 (real VAE class, tiny weights) with a mid-sized UMT5 text encoder (random weights, ~150 M parameters, built
here) so that what is done to the text encoder shows in the memory.

Each variant is a fresh process running the shard (`infra.preprocess.shard.process_shard`: decode, text, VAE,
writes); its peak RSS comes from ``wait4``, its seconds from inside (start-up and model load left out). Variants
alternate, ``--repeats`` times; medians and ratios against the baseline are printed. Then, in this process: the
largest difference ``--video-batch`` makes to stored latents (bf16) against batch one, with fp32 and bf16 compute.

    python bench/memory_bench.py                       # 4 clips, 1 run each (several minutes on 2 cores)
    python bench/memory_bench.py --frames 33 --size 832 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIP_NAMES = ("bigbuckbunny", "bikes", "carphone", "sample_1080p")
#: A mid-sized UMT5 (the real one is 4096 wide, 24 layers): enough weight for offload and int8 to show.
TEXT_CONFIG = {"d_model": 1024, "d_kv": 64, "d_ff": 2816, "num_layers": 12, "num_heads": 16}
VARIANTS: dict[str, dict[str, object]] = {
    "baseline": {},
    "video-batch 2": {"video_batch": 2},
    "video-batch 2 + vae-slicing": {"video_batch": 2, "vae_slicing": True},
    "vae-tiling": {"vae_tiling": True},
    "text-offload": {"text_offload": True},
    "text-quantize int8-dynamic": {"text_quantize": "int8-dynamic"},
    "vae-tiling + text-offload": {"vae_tiling": True, "text_offload": True},
}
TOLERANCE_GEOMETRY = (17, 128, 128)

logger = logging.getLogger("memory_bench")


def make_workload(root: Path, clips: int) -> tuple[Path, Path]:
    """(source dir, model dir): one shard of `clips` real clips, the tiny Wan2.2 with a mid-sized text encoder."""
    import torch  # noqa: PLC0415
    from transformers import UMT5Config, UMT5EncoderModel  # noqa: PLC0415

    from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: PLC0415
    from infra.demo.testmedia import real_clip  # noqa: PLC0415
    from infra.demo.tiny import make_tiny_wan22  # noqa: PLC0415

    model = make_tiny_wan22(root / "model", seed=0)
    small = UMT5Config.from_pretrained(model / "text_encoder")
    config = UMT5Config(**{**small.to_dict(), **TEXT_CONFIG})
    torch.manual_seed(0)
    UMT5EncoderModel(config).eval().save_pretrained(model / "text_encoder", safe_serialization=True)
    data = [real_clip(name).read_bytes() for name in CLIP_NAMES]
    generator = "G-11_handle_object_reappearance_data-generator"
    samples = [
        DemoSample(
            generator=generator,
            task="handle_object_reappearance",
            index=i,
            files={"ground_truth.mp4": data[i % len(data)], "prompt.txt": f"the object moves, template {i}".encode()},
        )
        for i in range(clips)
    ]
    (root / "src").mkdir()
    write_vbvr_tar(root / "src" / "shard.tar", samples)
    return root / "src", model


def child(spec: dict) -> None:
    """One variant's shard, in this process: prints {"seconds": ...} (the shard only)."""
    from infra.config import BuildConfig  # noqa: PLC0415
    from infra.plan import make_plan  # noqa: PLC0415
    from infra.preprocess.shard import process_shard  # noqa: PLC0415

    plan = make_plan(BuildConfig.model_validate(spec))
    start = time.perf_counter()
    result = process_shard(plan.job, plan.shards[0])
    seconds = time.perf_counter() - start
    sys.stdout.write(json.dumps({"seconds": seconds, "done": result.counts.get("done", 0)}) + "\n")


def run_variant(base: dict, options: dict, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of one variant in a fresh process."""
    spec = json.dumps({**base, **options, "out": str(out)})
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.Popen([sys.executable, __file__, "--child", spec], stdout=subprocess.PIPE, env=env, text=True)
    stdout = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"variant {options} failed (status {status})")
    answer = json.loads(stdout.strip().splitlines()[-1])
    return answer["seconds"], usage.ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def tolerance(model: Path) -> list[str]:
    """Max abs difference and share of differing values of stored (bf16) latents, batch 2 and 4 against 1."""
    import torch  # noqa: PLC0415

    from infra.models import load_family  # noqa: PLC0415
    from infra.models.memory import LoadOptions  # noqa: PLC0415
    from infra.preprocess.vae_calls import encode_group  # noqa: PLC0415

    frames, height, width = TOLERANCE_GEOMETRY
    gen = torch.Generator().manual_seed(0)
    clips = [torch.rand(1, 3, frames, height, width, generator=gen) * 2 - 1 for _ in range(4)]
    lines = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        encoder = load_family(model, "wan22", torch.device("cpu"), dtype, LoadOptions())
        one = [encode_group(encoder, [c], 1)[0] for c in clips]
        for batch in (2, 4):
            got = [r for i in range(0, 4, batch) for r in encode_group(encoder, clips[i : i + batch], batch)]
            diff = max(float((g.float() - o.float()).abs().max()) for g, o in zip(got, one, strict=True))
            share = sum(int((g != o).sum()) for g, o in zip(got, one, strict=True)) / sum(o.numel() for o in one)
            lines.append(f"{name} compute, batch {batch} vs 1: max abs diff {diff:.3g}, values differing {share:.2%}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=832)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        logging.basicConfig(level=logging.WARNING)
        child(json.loads(args.child))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="lf-memory-bench-") as tmp:
        root = Path(tmp)
        source, model = make_workload(root, args.clips)
        base = {"source": f"vbvr:{source}", "model": str(model), "device": "cpu", "dtype": "fp32"}
        base |= {"frames": args.frames, "height": args.size, "width": args.size, "on_conflict": "abort"}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            for i, (name, options) in enumerate(VARIANTS.items()):
                results[name].append(run_variant(base, options, root / f"out-{repeat}-{i}"))
                logger.info("%s: %.1f s, %.2f GB", name, *results[name][-1])
        median = {n: tuple(statistics.median(v[k] for v in r) for k in (0, 1)) for n, r in results.items()}
        base_s, base_gb = median["baseline"]
        logger.info("\n%d clips at %d×%d², fp32 CPU, OMP_NUM_THREADS=%s, median of %d", args.clips, args.frames,
                    args.size, os.environ.get("OMP_NUM_THREADS", "2"), args.repeats)  # fmt: skip
        logger.info("%-30s %9s %8s %10s %8s", "variant", "seconds", "× base", "peak GB", "× base")
        for name, (seconds, gb) in median.items():
            logger.info("%-30s %9.1f %8.2f %10.2f %8.2f", name, seconds, seconds / base_s, gb, gb / base_gb)
        for line in tolerance(model):
            logger.info(line)


if __name__ == "__main__":
    main()
