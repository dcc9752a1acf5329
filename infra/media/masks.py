"""Inpainting masks as the LTX-2 trainer preprocesses them (``process_videos.compute_video_masks`` /
``compute_audio_masks``): a mask file → a binary float32 mask on the latent grid of the latents it masks.

Video (``video_mask`` → ``video_masks/``): the mask video's first ``F`` frames (``F = (F' - 1)·t + 1``, the pixel
frames of the sample's latents), each the mean of its RGB values in [0, 1], resized by nearest neighbour to the
latents' pixel size ``(H'·s, W'·s)`` — stretched, not cover-cropped, as the trainer does; a still image (png, jpg,
webp, bmp, tiff: `is_still`) is its channel mean resized bilinearly (antialiased: torchvision's tensor resize) and
repeated over the ``F`` frames. Then a mean over each ``s×s`` block, a max over each run of ``t`` frames (frames
0..t-1, t..2t-1, ...; the last run padded with zeros), the first ``F'`` kept, and ``> 0.5``:
``{"mask": float32 [F', H', W']}``.

Audio (``audio_mask`` → ``audio_masks/``): a ``.pt`` tensor (or a dict: its ``mask``, else its first value),
flattened; else an audio file's mean absolute amplitude over channels. Resized by nearest neighbour to the audio
latents' ``T'`` steps and ``> 0.5``: ``{"mask": float32 [T']}``.

Where the trainer writes a mask the trainer cannot train on (a mask video shorter than the latents' frames gives
fewer mask frames than latent frames), latentforge refuses the sample (``video_mask_too_short``).
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F

from infra.errors import InputError
from infra.media.audio import decode_audio
from infra.media.image import is_image, load_rgb
from infra.media.video import DEFAULT_LIMITS, MediaLimits, head_frames


def video_mask(
    media: bytes, latent_grid: tuple[int, int, int], spatial: int, time: int, limits: MediaLimits = DEFAULT_LIMITS
) -> torch.Tensor:
    """The binary float32 mask ``[F', H', W']`` of a mask video or image over latents of `latent_grid`
    ``(F', H', W')`` from a VAE that compresses ``spatial`` × ``spatial`` pixels and ``time`` frames."""
    latent_f, latent_h, latent_w = latent_grid
    pixel_f, pixel_h, pixel_w = (latent_f - 1) * time + 1, latent_h * spatial, latent_w * spatial
    if is_still(media):
        rgb = torch.from_numpy(np.array(load_rgb(media, limits), dtype=np.uint8)).permute(2, 0, 1)
        gray = rgb.float().div(255.0).mean(dim=0, keepdim=True)  # [1, H, W], as to_tensor(...).mean(dim=0)
        size = (pixel_h, pixel_w)  # torchvision's tensor resize: bilinear, antialiased
        pixels = F.interpolate(gray[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]
        pixels = pixels.expand(pixel_f, -1, -1)  # [F, H, W]
    else:
        clip = head_frames(media, pixel_f, limits=limits)
        if clip.frames.shape[0] < pixel_f:
            raise InputError(
                "video_mask_too_short",
                f"the mask video decodes to {clip.frames.shape[0]} frame(s); the latents' {latent_f} frames need "
                f"{pixel_f}",
            )
        frames = torch.from_numpy(clip.frames[:pixel_f]).float().div(255.0).permute(0, 3, 1, 2).mean(dim=1)
        pixels = F.interpolate(frames.unsqueeze(1), size=(pixel_h, pixel_w), mode="nearest").squeeze(1)
    mask = F.avg_pool2d(pixels.unsqueeze(1), kernel_size=spatial).squeeze(1)  # [F, H', W']
    pad = (time - mask.shape[0] % time) % time
    if pad:
        mask = F.pad(mask, (0, 0, 0, 0, 0, pad))
    mask = mask.reshape(-1, time, latent_h, latent_w).amax(dim=1)[:latent_f]
    return (mask > 0.5).float()


def is_still(media: bytes) -> bool:
    """A mask given as a still image: png, jpg, webp, and bmp or tiff (the trainer takes a mask by its file name's
    extension, these among them; the bytes' signature says the same here)."""
    return is_image(media) or media[:2] == b"BM" or media[:4] in (b"II*\x00", b"MM\x00*")


def audio_mask_signal(media: bytes) -> torch.Tensor:
    """The raw 1-D mask of an audio mask file: a ``torch.save``d tensor (or dict) read with ``weights_only``, else
    the mean absolute amplitude of a decoded audio file; InputError ``audio_mask_unreadable``."""
    try:
        loaded = torch.load(io.BytesIO(media), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - not a tensor file: read as audio below
        loaded = None
    if loaded is not None:
        if isinstance(loaded, dict):
            loaded = loaded.get("mask", next(iter(loaded.values()), None))
        if not torch.is_tensor(loaded) or loaded.numel() == 0:
            raise InputError("audio_mask_unreadable", "the mask file holds no tensor")
        return loaded.float().flatten()
    wave = decode_audio(media)
    if wave is None:
        raise InputError("audio_mask_unreadable", "the audio mask file has no audio stream")
    return wave.samples.abs().mean(dim=0)


def audio_mask(signal: torch.Tensor, steps: int) -> torch.Tensor:
    """`signal` resized by nearest neighbour to `steps` audio latent steps, binarised: float32 ``[steps]``."""
    resized = F.interpolate(signal.float()[None, None], size=steps, mode="nearest")
    return (resized.reshape(steps) > 0.5).float()
