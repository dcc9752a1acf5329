"""The pixels a VAE fit trains on: a source's clips under the Wan2.2 recipe (linspace frames, /127.5 − 1,
bilinear), exactly as the build reads them, so the fitted VAE is judged on what it was fitted to."""

from __future__ import annotations

import logging

import torch

from infra.errors import ConfigError, InputError
from infra.media.resize import frames_to_pixels
from infra.media.video import sample_frames
from infra.sources.base import open_source

logger = logging.getLogger(__name__)


def training_clips(source: str, frames: int, height: int, width: int, limit: int = 16) -> dict[str, torch.Tensor]:
    """Up to `limit` clips of `source` (a `--source` spec, e.g. vbvr:DIR) as (1, 3, frames, height, width)
    pixels, keyed SHARD/KEY. Unreadable clips are skipped with a warning (as the build's ledger would fail
    them); ConfigError when none is usable."""
    clips: dict[str, torch.Tensor] = {}
    src = open_source(source)
    for shard in src.shards():
        for ref in src.samples(shard):
            if len(clips) >= limit:
                return clips
            try:
                media = ref.read_media()
                if media is None:
                    raise InputError("missing_media", "no video member")
                clip = sample_frames(media, frames)
            except InputError as exc:
                logger.warning("not training on %s/%s: %s", shard.id, ref.id, exc)
                continue
            clips[f"{shard.id}/{ref.id}"] = frames_to_pixels(clip.frames, height, width)
    if not clips:
        raise ConfigError(f"no usable clip in {source} to fit the VAE to")
    return clips
