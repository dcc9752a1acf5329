"""Wan image-to-video conditioning, as the Wan trainers make it from a clip's first frame.

Both trainers that cache Wan I2V data build the same tensors (read at kohya-ss/musubi-tuner commit
30c658c4f4b0bf05038b3346eff9670259b10fc7, ``src/musubi_tuner/wan_cache_latents.py`` ``encode_and_save_batch``,
and in ``diffsynth`` 2.1.12, ``pipelines/wan_video.py`` ``WanVideoUnit_ImageEmbedderVAE`` and
``WanVideoUnit_ImageEmbedderCLIP``):

* ``y`` (musubi's ``latents_image``): a mask of ones over the first pixel frame, zeros after, repeated 4 times for
  the first frame and folded to the latent frames (4 channels: the first latent frame all ones, the rest zeros), then
  the VAE latents of the first frame followed by F - 1 black frames (zeros in [-1, 1]);
* the CLIP features (Wan2.1 I2V): the first frame in [-1, 1] resized to the encoder's square size (bicubic,
  ``align_corners=False``, no crop), mapped to [0, 1], normalised with the CLIP mean and std, and the hidden states
  after the next-to-last transformer block (their CLIP's ``use_31_block=True``: transformers'
  ``hidden_states[-2]``), [257, 1280] for ViT-H/14.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: The first latent frame covers this many pixel frames in the mask (the VAE's temporal factor).
MASK_REPEAT = 4


def first_frame_mask(frames: int, latent_height: int, latent_width: int) -> torch.Tensor:
    """(4, F', h, w) float32: the trainers' mask, by their own steps (ones over the first of `frames` pixel frames,
    the first one repeated 4 times, folded into groups of 4)."""
    mask = torch.ones(1, frames, latent_height, latent_width)
    mask[:, 1:] = 0
    mask = torch.cat([torch.repeat_interleave(mask[:, 0:1], repeats=MASK_REPEAT, dim=1), mask[:, 1:]], dim=1)
    mask = mask.view(1, mask.shape[1] // MASK_REPEAT, MASK_REPEAT, latent_height, latent_width)
    return mask.transpose(1, 2)[0]


def first_frame_video(pixels: torch.Tensor) -> torch.Tensor:
    """(1,3,F,H,W) → the clip's first frame followed by F - 1 black frames (zeros in [-1, 1]), what the VAE encodes
    for ``y``."""
    video = torch.zeros_like(pixels)
    video[:, :, 0] = pixels[:, :, 0]
    return video


def clip_pixels(frame: torch.Tensor, size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """A frame (3,H,W) in [-1, 1] → the CLIP encoder's input (1,3,size,size), as the trainers' ``visual``
    preprocesses it."""
    x = F.interpolate(frame.unsqueeze(0).float(), size=(size, size), mode="bicubic", align_corners=False)
    x = x.mul(0.5).add(0.5)
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
