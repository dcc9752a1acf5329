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
  ``duration`` (float, seconds);
* ``reference_latents/`` (IC-LoRA): a ``latents/`` record of the reference video, named by the sample's video,
  its ``fps`` the source's divided by ``--reference-temporal-scale-factor``;
* ``video_masks/`` (video inpainting): ``mask`` float32 ``[F', H', W']`` of 0.0 / 1.0 on the latents' grid
  (`infra.media.masks`).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.formats.base import (
    AUDIO_KIND,
    AUDIO_MASK_KIND,
    REFERENCE_AUDIO_KIND,
    REFERENCE_KIND,
    VIDEO_MASK_KIND,
    EncodedSample,
    Format,
    PerSampleWriter,
    opened,
)
from infra.formats.consumer_glob import ConsumerGlob
from infra.media.temporal import effective_fps
from infra.outdir import OutFile

PRECOMPUTED = ".precomputed"
#: Output kind → the trainer's directory for it: every subfolder the trainer's modes name (`infra.models.ltx2_modes`).
DIRS: dict[str, str] = {
    "latents": "latents",
    "text_embeddings": "conditions",
    AUDIO_KIND: "audio_latents",
    REFERENCE_KIND: "reference_latents",
    REFERENCE_AUDIO_KIND: "reference_audio_latents",
    VIDEO_MASK_KIND: "video_masks",
    AUDIO_MASK_KIND: "audio_masks",
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


def _video_record(latents: torch.Tensor, fps: float) -> dict[str, Any]:
    """A video latents file as ``compute_latents`` saves it (the sample's, or an IC-LoRA reference's)."""
    _, frames, height, width = latents.shape
    return {
        "latents": latents.contiguous(),
        "num_frames": int(frames),
        "height": int(height),
        "width": int(width),
        "fps": float(fps),
    }


def _audio_record(latents: torch.Tensor, duration: float) -> dict[str, Any]:
    """An audio latents file as ``compute_latents`` / ``compute_audio_latents`` save it."""
    return {
        "latents": latents.to(torch.float32).contiguous(),
        "num_time_steps": int(latents.shape[1]),
        "frequency_bins": int(latents.shape[2]),
        "duration": float(duration),
    }


class LtxWriter(PerSampleWriter):
    """Writes a sample's latents, conditions and (for an audio run with an audio track) audio latents, and the
    files of its mode's other kinds it has (a reference's latents, masks)."""

    def __init__(self, out: Path, fmt: Format, temporal: str | None = None) -> None:
        super().__init__(out, fmt)
        self.temporal = temporal  # the spec's temporal policy: what fps the stored frames play at

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        conditions = {
            "video_prompt_embeds": sample.text_embeds.contiguous(),
            "prompt_attention_mask": sample.extras["prompt_attention_mask"].to(torch.int64).contiguous(),
            "audio_prompt_embeds": sample.extras["audio_prompt_embeds"].contiguous(),
        }
        files = [(["text_embeddings"], relpath("text_embeddings", sample.stem), _save(conditions))]
        if sample.latents is not None:  # none in an audio-only mode (t2a ...), as the trainer writes none
            latents = _video_record(sample.latents, trainer_fps(self.temporal, sample.info))
            files.insert(0, (["latents"], relpath("latents", sample.stem), _save(latents)))
        audio = sample.extras.get(AUDIO_KIND)
        if isinstance(audio, torch.Tensor):
            record = _audio_record(audio, sample.info["audio_duration"])
            files.append(([AUDIO_KIND], relpath(AUDIO_KIND, sample.stem), _save(record)))
        records = {
            REFERENCE_KIND: lambda t: _video_record(t, sample.info["reference_fps"]),
            REFERENCE_AUDIO_KIND: lambda t: _audio_record(t, sample.info["reference_audio_duration"]),
            VIDEO_MASK_KIND: lambda t: {"mask": t.to(torch.float32).contiguous()},
            AUDIO_MASK_KIND: lambda t: {"mask": t.to(torch.float32).contiguous()},
        }
        for kind, make in records.items():
            tensor = sample.extras.get(kind)
            if isinstance(tensor, torch.Tensor):
                files.append(([kind], relpath(kind, sample.stem), _save(make(tensor))))
        return files


class LtxFormat(Format):
    """The ltx format: the LTX-2 trainer's ``.precomputed`` layout."""

    name = "ltx"
    keys: ClassVar[dict[str, str]] = {
        "latents": "latents",
        "text_embeddings": "video_prompt_embeds",
        AUDIO_KIND: "latents",
        REFERENCE_KIND: "latents",
        REFERENCE_AUDIO_KIND: "latents",
        VIDEO_MASK_KIND: "mask",
        AUDIO_MASK_KIND: "mask",
    }
    #: ``PrecomputedDataset``: ``latents/**/*.pt`` and the file of the same relative path in every other source folder
    #: its mode names (the trainer's ``Path.glob``: hidden names included).
    consumer_glob = ConsumerGlob(tuple(f"{PRECOMPUTED}/{folder}/**/*.pt" for folder in DIRS.values()))

    def writer(self, out: Path) -> LtxWriter:
        return LtxWriter(out, self)

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> LtxWriter:
        return LtxWriter(out, self, getattr(spec, "temporal", None))

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        return {kind: relpath(kind, stem) for kind in kinds}

    def read(self, path: Path | OutFile) -> dict[str, Any]:
        with opened(path) as fh:
            return torch.load(fh, map_location="cpu", weights_only=True)
