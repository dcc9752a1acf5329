"""LTX-2's training modes (the trainer's ``--mode``): the roles each reads, and the settings each needs.

Each mode decides which ``.precomputed/`` subfolders a sample must have (ltx format: latents/, conditions/,
audio_latents/, reference_latents/, reference_audio_latents/, video_masks/, audio_masks/), through the output kind of
each role it reads (`infra.models.base.ROLES`). A video mode gets audio_latents too when its spec has audio.
"""

from __future__ import annotations

from typing import Any

from infra.errors import ConfigError
from infra.models.base import DEFAULT_MODE

#: Per LTX-2 mode: the dataset roles it reads (the trainer's column names).
MODE_ROLES: dict[str, tuple[str, ...]] = {
    "t2v": ("video", "caption"),
    "i2v": ("video", "caption"),
    "t2a": ("audio", "caption"),
    "v2v-ic-lora": ("video", "reference_video", "caption"),
    "av2av-ic-lora": ("video", "audio", "reference_video", "reference_audio", "caption"),
    "a2a-ic-lora": ("audio", "reference_audio", "caption"),
    "a2v": ("video", "audio", "caption"),
    "v2a": ("video", "audio", "caption"),
    "video-inpaint": ("video", "video_mask", "caption"),
    "audio-inpaint": ("audio", "audio_mask", "caption"),
}
#: The format every mode past t2v is written in: the trainer's own layout.
FORMAT = "ltx"


def check(encoding: Any) -> None:
    """ConfigError for a mode this run cannot make: a mode past t2v outside the LTX-2 layout, an audio mode without
    audio. (Every mode's roles are read; a dataset without a role the mode needs is refused when its source is
    listed.)"""
    mode = encoding.mode
    if mode == DEFAULT_MODE:
        return
    if encoding.format != FORMAT:
        raise ConfigError(
            f"--mode {mode}: modes are the LTX-2 trainer's, for --format ltx (this run: {encoding.format})"
        )
    if "audio" in MODE_ROLES[mode] and not encoding.audio:
        raise ConfigError(f"--mode {mode} trains on audio: drop --skip-audio / --no-audio (or give --audio)")
