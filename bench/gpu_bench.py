"""Accelerator throughput at real size: seconds per sample at 33×832×832 and the fraction of wall time the device is
busy, with nothing downloaded: a full-size Wan2.2 VAE and a UMT5-XXL-sized encoder built from their configs with
random weights (the same FLOPs as the real ones), on the device, in bf16.

The input side is latentforge's own: each sample's pixels are made from uint8 1080p frames by
`infra.media.video.resize_pixels` on a prefetch thread (`--prefetch` ahead) while the device encodes the current one;
prompts go through `infra.preprocess.texts.TextCache` (batched, a few unique prompts, as a task family has them).
Busy time is the device time of the encodes (CUDA events; on a CPU, the encode calls' own time).

    bash bench/gpu.sh                                   # cuda, full size, 8 samples
    python bench/gpu_bench.py --size tiny --device cpu --frames 5 --height 32 --width 32 --samples 2   # its CPU path

Prints one summary line: ``gpu-bench: device=... s/sample=... busy=...% ...``.
"""

from __future__ import annotations

import argparse
import logging
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.devices import resolve_device, resolve_dtype
from infra.media.video import resize_pixels
from infra.models.base import TextSettings
from infra.models.wan22 import Wan22Encoder
from infra.models.wan_constants import WAN22_VAE_CONFIG
from infra.preprocess.texts import TextCache

logger = logging.getLogger("gpu_bench")

#: UMT5-XXL (Wan2.2's text encoder) as its config gives it.
UMT5_XXL = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "tie_word_embeddings": False,
}
SOURCE_FRAME = (1080, 1920, 3)
PROMPTS = ("the object hides behind the box and comes back", "a ball follows a parabola and bounces twice")


def build_encoder(size: str, device: torch.device, dtype: torch.dtype, tiny_dir: Path | None) -> Wan22Encoder:
    """A Wan22Encoder whose models are built from configs (random weights) on `device`: full size, or the tiny
    model's configs (the CPU path of this script)."""
    from diffusers import AutoencoderKLWan  # noqa: PLC0415
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel  # noqa: PLC0415

    from infra.demo.tiny import build_tokenizer, make_tiny_wan22  # noqa: PLC0415

    torch.manual_seed(0)
    encoder = Wan22Encoder.__new__(Wan22Encoder)
    encoder.device, encoder.dtype = device, dtype
    if size == "tiny":
        model = make_tiny_wan22(tiny_dir) if not (tiny_dir / "model_index.json").exists() else tiny_dir
        vae = AutoencoderKLWan.from_pretrained(model / "vae")
        text = UMT5EncoderModel.from_pretrained(model / "text_encoder")
        tokenizer = AutoTokenizer.from_pretrained(model / "tokenizer")
    else:
        with torch.device(device):
            vae = AutoencoderKLWan(**{k: v for k, v in WAN22_VAE_CONFIG.items() if k != "clip_output"})
            text = UMT5EncoderModel(UMT5Config(**UMT5_XXL))
        tokenizer = build_tokenizer()
    encoder.vae = vae.to(device, dtype).eval()
    encoder.text_encoder = text.to(device, dtype).eval()
    encoder.tokenizer = tokenizer
    channels = vae.config.z_dim
    encoder.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, channels, 1, 1, 1)
    encoder.std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, channels, 1, 1, 1)
    encoder._lock = threading.Lock()
    return encoder


def _producer(args: argparse.Namespace, out: queue.Queue) -> None:
    """Pixels of each sample from uint8 source frames (latentforge's chunked resize), `--prefetch` ahead."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(args.frames, *SOURCE_FRAME), dtype=np.uint8)
    for i in range(args.samples + 1):  # one warm-up sample first
        pixels = resize_pixels(frames, args.height, args.width, "stretch")
        out.put((i, pixels.pin_memory() if torch.cuda.is_available() else pixels))
    out.put(None)


def run(args: argparse.Namespace) -> dict[str, float]:
    """Encode `args.samples` samples (after one warm-up); their seconds per sample and the busy fraction."""
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    encoder = build_encoder(args.size, device, dtype, Path(args.tiny_dir))
    texts, settings = TextCache(), TextSettings(512)
    ready: queue.Queue = queue.Queue(maxsize=args.prefetch)
    threading.Thread(target=_producer, args=(args, ready), daemon=True).start()
    cuda = device.type == "cuda"
    busy, start = 0.0, None
    while (item := ready.get()) is not None:
        index, pixels = item
        if index == 1:  # after the warm-up
            if cuda:
                torch.cuda.synchronize()
            start, busy = time.perf_counter(), 0.0
        began = time.perf_counter()
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if events:
            events[0].record()
        encoder.encode_video(pixels)
        texts.embedding(encoder, PROMPTS[index % len(PROMPTS)], settings, upcoming=PROMPTS, batch=len(PROMPTS))
        if events:
            events[1].record()
            events[1].synchronize()
            busy += events[0].elapsed_time(events[1]) / 1000
        else:
            busy += time.perf_counter() - began
    wall = time.perf_counter() - (start or time.perf_counter())
    return {"seconds_per_sample": wall / args.samples, "busy": busy / wall if wall else 0.0, "wall": wall}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=832)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--tiny-dir", default="/tmp/lf-gpu-bench-tiny")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    line = (
        f"gpu-bench: device={args.device} size={args.size} geometry={args.frames}x{args.height}x{args.width} "
        f"samples={args.samples} s/sample={result['seconds_per_sample']:.3f} busy={result['busy']:.1%} "
        f"(targets: <= 1 s/sample, >= 95% busy on one H200)"
    )
    print(line)
    return line


if __name__ == "__main__":
    main()
