"""The LTX-2 trainer's layout, ``ltx``: ``OUT/.precomputed/{latents,conditions,audio_latents}/<stem>.pt``, where
the stem is the media path relative to the metadata file's directory without its extension (nested folders
kept), exactly what the trainer's ``PrecomputedDataset`` matches across its sources.

Keys and dtypes as ``process_dataset.py`` writes them, and nothing else (so a file carries no fingerprint: a file
left by an interrupted run is adopted only when it holds exactly the bytes this run renders):

* ``latents/``: ``latents`` bf16 ``[128, F', H', W']``, ``num_frames``, ``height``, ``width`` (latent sizes, int),
  ``fps`` (float);
* ``conditions/``: ``video_prompt_embeds`` bf16 ``[1024, D]``, ``prompt_attention_mask`` int64 ``[1024]`` (left
  padding, 1 = real token), ``audio_prompt_embeds`` (for LTX-2.0 the same tensor as the video one);
* ``audio_latents/``: ``latents`` float32 ``[8, T', 16]``, ``num_time_steps``, ``frequency_bins`` (int),
  ``duration`` (float, seconds).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.formats.base import AUDIO_KIND, EncodedSample, Format, PerSampleWriter

PRECOMPUTED = ".precomputed"
#: Output kind → the trainer's directory for it.
DIRS: dict[str, str] = {"latents": "latents", "text_embeddings": "conditions", AUDIO_KIND: "audio_latents"}
#: Every subfolder the trainer's modes name (`infra.config.MODE_ROLES`), by output kind: what a mode requires, in
#: the trainer's words. Those past `DIRS` belong to modes latentforge refuses at plan time.
SUBFOLDERS: dict[str, str] = {
    **DIRS,
    "reference_latents": "reference_latents",
    "reference_audio_latents": "reference_audio_latents",
    "video_masks": "video_masks",
    "audio_masks": "audio_masks",
}


def _save(record: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def relpath(kind: str, stem: str) -> str:
    """OUT-relative path of one kind of a sample: ``.precomputed/<dir>/<stem>.pt``."""
    return f"{PRECOMPUTED}/{DIRS[kind]}/{stem}.pt"


class LtxWriter(PerSampleWriter):
    """Writes a sample's latents, conditions and (for an audio run with an audio track) audio latents."""

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        _, frames, height, width = sample.latents.shape
        latents = {
            "latents": sample.latents.contiguous(),
            "num_frames": int(frames),
            "height": int(height),
            "width": int(width),
            "fps": float(sample.info["fps"]),
        }
        conditions = {
            "video_prompt_embeds": sample.text_embeds.contiguous(),
            "prompt_attention_mask": sample.extras["prompt_attention_mask"].to(torch.int64).contiguous(),
            "audio_prompt_embeds": sample.extras["audio_prompt_embeds"].contiguous(),
        }
        files = [
            (["latents"], relpath("latents", sample.stem), _save(latents)),
            (["text_embeddings"], relpath("text_embeddings", sample.stem), _save(conditions)),
        ]
        audio = sample.extras.get(AUDIO_KIND)
        if isinstance(audio, torch.Tensor):
            record = {
                "latents": audio.to(torch.float32).contiguous(),
                "num_time_steps": int(audio.shape[1]),
                "frequency_bins": int(audio.shape[2]),
                "duration": float(sample.info["audio_duration"]),
            }
            files.append(([AUDIO_KIND], relpath(AUDIO_KIND, sample.stem), _save(record)))
        return files


class LtxFormat(Format):
    """The ltx format: the LTX-2 trainer's ``.precomputed`` layout."""

    name = "ltx"
    keys: ClassVar[dict[str, str]] = {
        "latents": "latents",
        "text_embeddings": "video_prompt_embeds",
        AUDIO_KIND: "latents",
    }

    def writer(self, out: Path) -> LtxWriter:
        return LtxWriter(out, self)

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        return {kind: relpath(kind, stem) for kind in kinds}

    def read(self, path: Path) -> dict[str, Any]:
        return torch.load(path, map_location="cpu", weights_only=True)
