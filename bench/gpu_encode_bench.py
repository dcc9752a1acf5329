"""E, the accelerator's encode seconds per sample: the Wan2.2 VAE and a UMT5-XXL text encoder at full size, bf16,
random weights made on the device, called as the build calls them (`infra.models.wan22`): one VAE call per batch of
33×832² clips, ``vae.encode(pixels).latent_dist.mode()``, normalised, bf16 to the host; prompts padded to 512
tokens, ``text_encoder(ids, mask).last_hidden_state``, `--text-batch` prompts a call. Timed with CUDA events (the
host clock elsewhere) after an untimed warm-up, per `--video-batch`.

Needs only torch, diffusers and transformers, so it runs on a GPU host that has none of the project's other
dependencies (the configs are read from the project's files, not imported with their modules). It is the encode
bound alone: `bench/gpu.sh` runs the whole product around the same calls. Prints one summary line:

    python bench/gpu_encode_bench.py                          # cuda, full size
    python bench/gpu_encode_bench.py --device cpu --size tiny --geometry 5 32 32   # its CPU path
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from transformers import UMT5Config, UMT5EncoderModel

ROOT = Path(__file__).resolve().parents[1]
TEXT_TOKENS, PROMPT_TOKENS = 512, 200
TINY_VOCAB = 32128  # the CPU path's text vocabulary (a tokenizer's size does not change the timing's shape)

logger = logging.getLogger("gpu_encode_bench")


def _literals(path: Path, *names: str) -> list[Any]:
    """The values of module-level literal assignments `names` in `path`, read without importing it."""
    values = {
        target.id: node.value
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return [ast.literal_eval(values[name]) for name in names]


def project_configs(size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Wan2.2 VAE config (`infra/models/wan_constants.py`, loaded alone) and the UMT5 sizes of `infra/demo/tiny.py`
    (UMT5-XXL, or the tiny model's), as `make_wan22` builds them, without importing their packages."""
    spec = importlib.util.spec_from_file_location("wan_constants", ROOT / "infra/models/wan_constants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vae = {k: v for k, v in module.WAN22_VAE_CONFIG.items() if k != "clip_output"}
    xxl, tiny_vae, tiny_text = _literals(ROOT / "infra/demo/tiny.py", "UMT5_XXL", "TINY_VAE_OVERRIDES", "TINY_UMT5")
    if size == "tiny":
        return vae | tiny_vae, {**tiny_text, "vocab_size": TINY_VOCAB}
    return vae, xxl


def build(size: str, device: torch.device, dtype: torch.dtype) -> tuple[AutoencoderKLWan, UMT5EncoderModel]:
    vae_config, text_config = project_configs(size)
    torch.manual_seed(0)
    with device:
        vae = AutoencoderKLWan(**vae_config).to(dtype).eval()
        config = UMT5Config(**text_config, feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0)
        text = UMT5EncoderModel(config).to(dtype).eval()
    return vae, text


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds one call of `fn` takes on `device` (CUDA events there, the host clock elsewhere)."""

    def timed(fn: Callable[[], Any]) -> float:
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000

    return timed


def main(argv: list[str] | None = None) -> str:
    """Measure, print and return the summary line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--geometry", type=int, nargs=3, default=[33, 832, 832], metavar=("F", "H", "W"))
    parser.add_argument("--video-batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--text-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3, help="timed calls per setting, after one untimed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device, dtype = torch.device(args.device), torch.bfloat16
    began = time.perf_counter()
    vae, text = build(args.size, device, dtype)
    setup = time.perf_counter() - began
    channels = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, channels, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, channels, 1, 1, 1)
    frames, height, width = args.geometry
    timed, parts = timer(device), []
    vae_s: dict[int, float] = {}
    for batch in args.video_batch:
        pixels = torch.rand(batch, 3, frames, height, width, device=device, dtype=dtype) * 2 - 1

        @torch.inference_mode()
        def encode_videos(pixels: torch.Tensor = pixels) -> torch.Tensor:
            z = vae.encode(pixels).latent_dist.mode()
            return ((z.float() - mean) / std).to(torch.bfloat16).cpu()

        encode_videos()
        vae_s[batch] = min(timed(encode_videos) for _ in range(args.reps)) / batch
        parts.append(f"vb{batch}: {vae_s[batch]:.3f} s/clip")
        logger.info("video batch %d: %.3f s a clip (best of %d)", batch, vae_s[batch], args.reps)
    ids = torch.randint(2, text.config.vocab_size, (args.text_batch, TEXT_TOKENS), device=device)
    mask = torch.zeros_like(ids)
    mask[:, :PROMPT_TOKENS] = 1

    @torch.inference_mode()
    def encode_texts() -> torch.Tensor:
        return text(input_ids=ids, attention_mask=mask).last_hidden_state.to(torch.bfloat16).cpu()

    encode_texts()
    text_s = min(timed(encode_texts) for _ in range(args.reps)) / args.text_batch
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    best = min(vae_s.values())
    line = (
        f"gpu-encode: device={device.type} size={args.size} geometry={frames}x{height}x{width} dtype=bf16 | "
        f"{' | '.join(parts)} | text: {text_s:.4f} s/prompt (batch {args.text_batch}, {TEXT_TOKENS} tokens) | "
        f"E={best + text_s:.3f} s/sample (best VAE batch + one unique prompt) peak={peak:.1f}GiB "
        f"setup={setup:.1f}s total={time.perf_counter() - began:.1f}s"
    )
    print(line)
    return line


if __name__ == "__main__":
    main()
