"""The LTX-2 trainer's layout, ``ltx``: ``OUT/.precomputed/{latents,conditions,audio_latents}/<stem>.pt``, where
the stem is the media path relative to the metadata file's directory without its extension (nested folders
kept), exactly what the trainer's ``PrecomputedDataset`` matches across its sources.

Keys and dtypes as ``process_dataset.py`` writes them, and nothing else (so a file carries no fingerprint: a file
left by an interrupted run is adopted only when it holds exactly the bytes this run renders):

* ``latents/``: ``latents`` bf16 ``[128, F', H', W']``, ``num_frames``, ``height``, ``width`` (latent sizes, int),
  ``fps`` (float: the rate of the frames stored, `trainer_fps`; the trainer stores source fps / its temporal
  subsample factor);
* ``conditions/``: ``video_prompt_embeds`` bf16 ``[1024, D]``, ``prompt_attention_mask`` int64 ``[1024]`` (left
  padding, 1 = real token), ``audio_prompt_embeds`` (for LTX-2.0 the same tensor as the video one);
* ``audio_latents/``: ``latents`` float32 ``[8, T', 16]``, ``num_time_steps``, ``frequency_bins`` (int),
  ``duration`` (float, seconds).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.formats.base import AUDIO_KIND, EncodedSample, Format, PerSampleWriter
from infra.media.temporal import effective_fps

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


def trainer_fps(temporal: str | None, info: dict[str, Any]) -> float:
    """The rate of the frames a sample stores, in the trainer's arithmetic: N under ``fps:N``; frames every K-th
    source frame (``head``: K = 1, ``stride:K``, ``windows:K``; a held last frame aside) native / K, as
    ``process_videos.py`` stores ``fps / temporal_subsample_factor``; other picks (``span``) native / their mean
    step. Native: the stream's rate as the trainer reads it (1.0 for a still)."""
    if temporal and temporal.startswith("fps:"):
        return float(temporal.split(":", 1)[1])
    native = float(info["fps"])
    indices = tuple((info.get("sampling") or {}).get("indices") or ())
    steps = {b - a for a, b in itertools.pairwise(indices)} - {0}
    if len(steps) == 1:
        return native / steps.pop()
    return effective_fps(indices, native)


class LtxWriter(PerSampleWriter):
    """Writes a sample's latents, conditions and (for an audio run with an audio track) audio latents."""

    def __init__(self, out: Path, fmt: Format, temporal: str | None = None) -> None:
        super().__init__(out, fmt)
        self.temporal = temporal  # the spec's temporal policy: what fps the stored frames play at

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        _, frames, height, width = sample.latents.shape
        latents = {
            "latents": sample.latents.contiguous(),
            "num_frames": int(frames),
            "height": int(height),
            "width": int(width),
            "fps": trainer_fps(self.temporal, sample.info),
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

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> LtxWriter:
        return LtxWriter(out, self, getattr(spec, "temporal", None))

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        return {kind: relpath(kind, stem) for kind in kinds}

    def read(self, path: Path) -> dict[str, Any]:
        return torch.load(path, map_location="cpu", weights_only=True)
