"""Frames and latents against each consumer's own preprocessing, before (the policy the recipe used) and after (the
consumer's named policy): per source size × consumer, the frame PSNR (pixels in [-1, 1], peak 2) and the latents'
relative distance ``||ours - theirs|| / ||theirs||`` of the stored (bf16) latents through the tiny Wan2.1 VAE
(make-tiny-model --family wan21), beside what one bf16 rounding alone moves the consumer's float32 posterior mean.

The frame is the first of the real 1080p test clip, resized (Pillow LANCZOS) to each source size. The consumers' own:
musubi-tuner's ``resize_image_to_bucket`` restated at its pinned commit (tests/test_resize_parity.py), DiffSynth's own
``ImageCropAndResize`` and ``preprocess_video`` from the ``diffsynth`` 2.1.12 wheel, FastVideo 0.2.1's LTX-2
``preprocess_ltx2_overfit`` arithmetic and its ``CenterCropResizeVideo`` (Wan), restated from its wheel.

    PYTHONPATH=. python bench/resize_parity_bench.py     # ~2 min on 2 cores; prints a markdown table
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from infra.demo.testmedia import real_clip
from infra.demo.tiny_wan21 import make_tiny_wan21
from infra.media.buckets import choose_musubi_bucket, musubi_buckets
from infra.media.resize import resize_pixels
from infra.models import load_family
from tests import diffsynth_ref as ds
from tests.test_resize_parity import _musubi_reference, _pixels

SOURCES = ((1366, 768), (720, 480), (1080, 1920), (1920, 1080), (176, 144), (40, 24))


def _first_frame() -> np.ndarray:
    with av.open(str(real_clip("sample_1080p"))) as container:
        return next(container.decode(video=0)).to_ndarray(format="rgb24")


def _musubi(frame: np.ndarray, height: int, width: int) -> torch.Tensor:
    return _pixels(_musubi_reference(Image.fromarray(frame), (width, height)))


def _diffsynth(frame: np.ndarray, height: int, width: int) -> torch.Tensor:
    pipe = ds.diffsynth().wan_video.WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    return pipe.preprocess_video(ds.crop_resize([Image.fromarray(frame)], height, width))[0, :, 0]


def _fastvideo_ltx2(frame: np.ndarray, height: int, width: int) -> torch.Tensor:
    """FastVideo 0.2.1 ``preprocess_ltx2_overfit.py``: rounded cover, bilinear antialias, ``// 2`` crop, /127.5 - 1."""
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
    scale = max(height / x.shape[2], width / x.shape[3])
    new_h, new_w = round(x.shape[2] * scale), round(x.shape[3] * scale)
    x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", antialias=True)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return (x[:, :, top : top + height, left : left + width] / 127.5 - 1.0)[0]


def _fastvideo_wan(frame: np.ndarray, height: int, width: int) -> torch.Tensor:
    """FastVideo 0.2.1 ``CenterCropResizeVideo``: crop to the aspect (truncated, offsets rounded), then bilinear
    ``align_corners=True`` with antialias; then its ``Normalize255`` and ``(x - 0.5) / 0.5``."""
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
    h, w = x.shape[2:]
    ratio = height / width
    new_h, new_w = (int(w * ratio), w) if h / w > ratio else (h, int(h / ratio))
    i, j = round((h - new_h) / 2.0), round((w - new_w) / 2.0)
    x = x[:, :, i : i + new_h, j : j + new_w]
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=True, antialias=True)
    return ((x / 255.0 - 0.5) / 0.5)[0]


#: consumer → (the target of a source (width, height) → (height, width), its own pixels, the policy before, after)
CONSUMERS: dict[str, tuple[Callable, Callable, str, str]] = {
    "musubi 832x480": (
        lambda w, h: (lambda b: (b.height, b.width))(choose_musubi_bucket(musubi_buckets(832, 480, 1), 1, h, w)),
        _musubi,
        "cover-crop",
        "musubi",
    ),
    "musubi 256x160": (
        lambda w, h: (lambda b: (b.height, b.width))(choose_musubi_bucket(musubi_buckets(256, 160, 1), 1, h, w)),
        _musubi,
        "cover-crop",
        "musubi",
    ),
    "diffsynth 480x832": (lambda w, h: (480, 832), _diffsynth, "cover-crop-aa", "diffsynth"),
    "diffsynth 64x96": (lambda w, h: (64, 96), _diffsynth, "cover-crop-aa", "diffsynth"),
    "fastvideo-ltx2 480x832 (parquet)": (lambda w, h: (480, 832), _fastvideo_ltx2, "cover-crop-aa", "cover-crop-aa"),
    "fastvideo wan 480x832 (parquet)": (lambda w, h: (480, 832), _fastvideo_wan, "stretch", "stretch"),
}


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a - b) / 2).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    torch.set_grad_enabled(False)
    big = _first_frame()
    with tempfile.TemporaryDirectory(prefix="lf-resize-bench-") as tmp:
        family = load_family(make_tiny_wan21(Path(tmp) / "wan21"), "wan21", torch.device("cpu"), torch.float32)
        print("| source | consumer | target | PSNR before | after | latent distance before | after | bf16 alone |")
        print("|---|---|---|---|---|---|---|---|")
        for width, height in SOURCES:
            frame = np.asarray(Image.fromarray(big).resize((width, height), Image.Resampling.LANCZOS))
            for consumer, (target, own, before, after) in CONSUMERS.items():
                h, w = target(width, height)
                theirs = own(frame, h, w)
                latent = family.encode_video(theirs[:, None][None])
                raw = family.encode_raw_videos([theirs[:, None][None]])[0]  # float32: one bf16 rounding's yardstick
                bf16 = _distance(raw.to(torch.bfloat16).float(), raw)
                cells = []
                for policy in (before, after):
                    ours = resize_pixels(frame[None], h, w, policy)[0, :, 0]
                    cells.append((_psnr(ours, theirs), _distance(family.encode_video(ours[:, None][None]), latent)))
                (p0, d0), (p1, d1) = cells
                print(
                    f"| {width}×{height} | {consumer} | {w}×{h} | {p0:.1f} dB | {p1:.1f} dB | {100 * d0:.2f}% | "
                    f"{100 * d1:.2f}% | {100 * bf16:.2f}% |"
                )


if __name__ == "__main__":
    main()
