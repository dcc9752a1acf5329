"""The Wan VAE's decode for decode-and-verify, through diffusers' public API only.

`AutoencoderKLWan.decode` runs its decoder one latent frame at a time over a causal feature cache and returns the
whole video; diffusers has no public way to run that loop a few frames per call or to take its frames as they come
(the cache is the VAE's private ``_feat_map`` / ``_conv_idx``; read in diffusers 0.42.1). So:

* a frame of at most `WHOLE_DECODE_MAX_AREA` pixels: ``vae.decode(z)``, the whole tensor: the pixels of the
  family's `decode` bit for bit;
* a larger frame: the same call with diffusers' spatial tiling (``vae.enable_tiling``, `TILE` / `TILE_STRIDE`),
  so the decoder's activations are a tile's, not the frame's; its pixels are the tiled decode's (tiles blended
  over their overlap), not the whole decode's. Tiling is switched off again after: the VAE's encode is unchanged.

The caller moves the pixels to the CPU `latent_spans` at a time (the first latent frame's pixel frame, then 4 ×
`DECODE_CHUNK` frames), so no whole float32 copy of a bf16 decode is made on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

#: Latent frames' worth of pixel frames (4 × as many) handed to the caller at a time, after the first.
DECODE_CHUNK = 2
#: The largest frame (height × width, pixels) decoded whole; a larger one is decoded in spatial tiles.
WHOLE_DECODE_MAX_AREA = 1280 * 720
#: diffusers' own tile for the Wan VAE: 256² pixels, a new tile every 192 (64 blended).
TILE, TILE_STRIDE = 256, 192


def latent_spans(frames: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `frames` latent frames: the first alone, then `chunk` at a time."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(0, min(1, frames))] + [(a, min(a + chunk, frames)) for a in range(1, frames, chunk)]


def pixel_spans(latent_frames: int, chunk: int, ratio: int) -> list[tuple[int, int]]:
    """The pixel frames [start, end) each latent span decodes to (`ratio` pixel frames per latent frame after the
    first, which decodes to one)."""
    return [(max(0, ratio * (a - 1) + 1), ratio * (b - 1) + 1) for a, b in latent_spans(latent_frames, chunk)]


@torch.inference_mode()
def decode_video(
    vae: Any, z: torch.Tensor, max_area: int = WHOLE_DECODE_MAX_AREA, tile: tuple[int, int] = (TILE, TILE_STRIDE)
) -> torch.Tensor:
    """Unnormalised latents `z` (1, C, F', H', W') on the VAE's device → pixels (1, 3, f, H, W) in [-1, 1] on the
    VAE's device and dtype: the whole decode, or the tiled one (`tile`: size and stride in pixels) when a frame is
    larger than `max_area` pixels."""
    ratio = vae.config.scale_factor_spatial
    if z.shape[-2] * z.shape[-1] * ratio * ratio <= max_area:
        return vae.decode(z).sample
    size, stride = tile
    vae.enable_tiling(
        tile_sample_min_height=size,
        tile_sample_min_width=size,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
    )
    try:
        return vae.decode(z).sample
    finally:
        vae.disable_tiling()
