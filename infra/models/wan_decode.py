"""The Wan VAE's decode, a few latent frames per decoder call, yielding pixels as they come.

`AutoencoderKLWan._decode` runs the decoder one latent frame at a time over a causal feature cache, concatenates
every output (a full-size copy per frame), unpatchifies and clamps. This is the same loop with two changes:

* after the first latent frame (alone, as there: the first-frame path, ``first_chunk=True``) the decoder takes
  `chunk` latent frames per call. The causal convolutions see the same frames (their cache holds the last two),
  so the numbers are the frame-by-frame decode's within float tolerance; ``chunk=1`` is that decode bit for bit.
  Larger calls are fewer kernel launches on an accelerator, and on CPU they pass PyTorch's size heuristic for
  the oneDNN 3-D convolution (a 4-frame call at full resolution with few channels falls back to a ~5× slower
  native kernel);
* each call's pixels are unpatchified, clamped and yielded at once, so no full-size decoded copy is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

#: Latent frames per decoder call after the first (4 × as many pixel frames).
DECODE_CHUNK = 2


def latent_spans(frames: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each decoder call over `frames` latent frames: the first alone, then `chunk` at a time."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(0, min(1, frames))] + [(a, min(a + chunk, frames)) for a in range(1, frames, chunk)]


@torch.inference_mode()
def decode_in_chunks(vae: Any, z: torch.Tensor, chunk: int = DECODE_CHUNK) -> Iterator[torch.Tensor]:
    """Unnormalised latents `z` (1, C, F', H', W') on the VAE's device → pixels (1, 3, f, H, W) in [-1, 1], on the
    VAE's device and dtype, in order, one decoder call at a time. The VAE's feature cache is cleared before and
    after (also when the consumer stops early)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify  # noqa: PLC0415 - heavy import

    vae.clear_cache()
    try:
        x = vae.post_quant_conv(z)
        for start, end in latent_spans(z.shape[2], chunk):
            vae._conv_idx = [0]  # the decoder's cache index, reset per call as _decode does
            out = vae.decoder(
                x[:, :, start:end], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=start == 0
            )
            if vae.config.patch_size is not None:
                out = unpatchify(out, patch_size=vae.config.patch_size)
            yield out.clamp_(-1.0, 1.0)
    finally:
        vae.clear_cache()
