"""A still image as an image family's consumer prepares it: its own loader's pixels, its bucket, its resize.

An image family whose format's consumer declares a frame policy of `infra.media.resize` (``musubi``, ``diffsynth``)
takes the image as that consumer's loader holds it, not latentforge's (`infra.media.image.load_rgb` turns it upright
and lays transparency over white):

* musubi-tuner (``dataset/datasources.py`` at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7): ``Image.open``, a
  mode other than RGB or RGBA converted to RGB, no EXIF orientation; an RGBA image is resized with its alpha (Pillow
  resamples it premultiplied) and the alpha dropped after (``cache_latents.encode_datasets``: ``content[..., :3]``);
* DiffSynth-Studio (``core/data/operators.py`` ``LoadImage`` of the ``diffsynth`` 2.1.12 package):
  ``Image.open(...).convert("RGB")`` (alpha dropped, not composited), no EXIF orientation.

``--rotate auto`` turns the image by its EXIF orientation first (neither consumer does). With buckets (musubi's
``resolution``) the image's bucket is chosen from its stored size by the spec's layout rule
(`infra.media.buckets.bucket_rule`); then the consumer's resize of the frame and its value scaling, in the run's
dtype (`infra.media.resize.FramePolicy`).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import ImageOps

from infra.media.buckets import Bucket, bucket_rule
from infra.media.image import open_image
from infra.media.resize import FramePolicy, policy
from infra.media.video import DEFAULT_LIMITS, MediaLimits, SampledClip

#: The resize policies an image family runs as its consumer's own code on the one image.
CONSUMER_POLICIES = ("musubi", "diffsynth")
#: Policies whose loader keeps an RGBA image's alpha through the resize (dropped after it).
_KEEPS_ALPHA = ("musubi",)
#: Policies whose consumer scales an image's values in float32 and casts them to its VAE's dtype at the VAE:
#: musubi's ``qwen_image_cache_latents.py`` (``contents / 127.5 - 1.0`` on the uint8 tensor, then ``.to(vae.dtype)``;
#: its Wan video caching scales in the VAE's dtype). DiffSynth's ``preprocess_image`` scales in its dtype.
_SCALES_IN_FLOAT32 = ("musubi",)


def consumer_array(media: bytes, name: str, upright: bool, limits: MediaLimits = DEFAULT_LIMITS) -> np.ndarray:
    """The image as the consumer of policy `name` holds it before resizing: (H, W, 3) uint8, or (H, W, 4) for an
    RGBA image musubi resizes with its alpha."""
    image = open_image(media, limits)
    if upright:
        image = ImageOps.exif_transpose(image) or image
    keep = name in _KEEPS_ALPHA and image.mode == "RGBA"
    return np.array(image if keep or image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)


def still_pixels(
    media: bytes,
    name: str,
    height: int,
    width: int,
    *,
    buckets: list[Bucket] | None = None,
    layout: str | None = None,
    upright: bool = False,
    dtype: torch.dtype = torch.float32,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> tuple[torch.Tensor, SampledClip, Bucket | None]:
    """(pixels (1, 3, 1, h, w) float32 (the run's dtype's values where the consumer scales in it), the one-frame
    clip, the bucket chosen or None) of an image by the consumer policy `name` (`CONSUMER_POLICIES`): its own loader,
    its bucket among `buckets` (by the `layout`'s rule), else `height`×`width`."""
    chosen = policy(name)
    if name not in CONSUMER_POLICIES or not isinstance(chosen, FramePolicy):
        raise ValueError(f"resize policy {name!r} is not one of {', '.join(CONSUMER_POLICIES)}")
    array = consumer_array(media, name, upright, limits)
    bucket = None
    if buckets:
        bucket = bucket_rule(layout)(buckets, 1, array.shape[0], array.shape[1])
        height, width = bucket.height, bucket.width
    resized = np.ascontiguousarray(chosen.resize_frame(array, height, width)[..., :3])
    if resized.shape[:2] != (height, width):
        raise ValueError(f"policy {name} made {resized.shape[1]}x{resized.shape[0]}, not {width}x{height}")
    scale_dtype = torch.float32 if name in _SCALES_IN_FLOAT32 else dtype
    pixels = chosen.scale(torch.from_numpy(resized)[None], scale_dtype).float().permute(0, 3, 1, 2)[:, :, None]
    clip = SampledClip(resized[None], 1, array.shape[0], array.shape[1], (0,), fps=1.0)
    return pixels.contiguous(), clip, bucket
