"""musubi-tuner's Qwen-Image cache (architecture code ``qi``), ``--format musubi`` with family qwen-image.

Restated from kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7
(``src/musubi_tuner/qwen_image_cache_latents.py``, ``qwen_image_cache_text_encoder_outputs.py``,
``dataset/cache_io.py`` ``save_latent_cache_qwen_image`` / ``save_text_encoder_output_cache_qwen_image``,
``dataset/image_video_dataset.py`` ``ImageDataset``, ``dataset/architectures.py``):

* an image's latents: ``{name}_{W:04d}x{H:04d}_qi.safetensors``, W×H the image's own size (an image dataset's item
  is named by its size before ``resize_image_to_bucket``: its loader recomputes the bucket from it), key
  ``latents_1x{H'}x{W'}_bfloat16`` [16, 1, H', W'] (the VAE's normalised latents of the one frame, in its dtype:
  bf16 for the released weights); metadata ``architecture=qwen_image``, ``width``, ``height``,
  ``format_version=1.0.1``;
* the caption: ``{name}_qi_te.safetensors``, ``varlen_vl_embed_bfloat16`` [L, 3584]: Qwen2.5-VL's rows of the
  caption past the template's 34 (its ``get_qwen_prompt_embeds``, then ``embed_i[:txt_len]``); metadata
  ``architecture=qwen_image``, ``caption1``, ``format_version``.

Names, the latentforge marks in the metadata and ``musubi_dataset.toml`` (an image dataset: ``image_directory``)
are as for the Wan cache (`infra.formats.musubi`). Its loader (``BucketBatchManager``) names the keys ``latents``
and ``vl_embed``. The edit variant (``qie``: control latents, captions encoded with the control image) is not made.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import torch

from infra import outdir
from infra.formats.base import EncodedSample
from infra.formats.musubi import (
    FINGERPRINT_KEY,
    FORMAT_VERSION,
    GROUP_KEY,
    ID_KEY,
    MusubiFormat,
    MusubiWriter,
    flat_name,
)
from infra.formats.musubi_toml import check_cache_directory
from infra.formats.safetensors_bytes import safetensors_bytes

ARCHITECTURE = "qi"
ARCHITECTURE_FULL = "qwen_image"


def latent_name(stem: str, width: int, height: int) -> str:
    """The latents file's name, as its ``ImageDataset.get_latent_cache_path`` makes it (W×H: the image's size)."""
    return f"{flat_name(stem)}_{width:04d}x{height:04d}_{ARCHITECTURE}.safetensors"


def text_name(stem: str) -> str:
    return f"{flat_name(stem)}_{ARCHITECTURE}_te.safetensors"


def render(sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
    """(kinds, OUT-relative path, bytes) of the sample's latents file and its caption file."""
    assert sample.latents is not None and sample.text_embeds is not None
    _, frames, h, w = sample.latents.shape
    _, height, width, _ = sample.source_shape
    marks = {FINGERPRINT_KEY: sample.fingerprint, GROUP_KEY: sample.group, ID_KEY: sample.id}
    tensors = {f"latents_{frames}x{h}x{w}_bfloat16": sample.latents.to(torch.bfloat16).contiguous()}
    metadata = {"architecture": ARCHITECTURE_FULL, "width": str(width), "height": str(height)}
    metadata |= {"format_version": FORMAT_VERSION} | marks
    text = {"varlen_vl_embed_bfloat16": sample.text_embeds[: sample.seq_len].to(torch.bfloat16).contiguous()}
    caption = {"architecture": ARCHITECTURE_FULL, "caption1": sample.prompt, "format_version": FORMAT_VERSION}
    return [
        (["latents"], latent_name(sample.stem, width, height), safetensors_bytes(tensors, metadata)),
        (["text_embeddings"], text_name(sample.stem), safetensors_bytes(text, caption | marks)),
    ]


class MusubiQiWriter(MusubiWriter):
    """The Wan writer's keeping of an identical file left by an interrupted run, with the ``qi`` files."""

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        return render(sample)


class MusubiQiFormat(MusubiFormat):
    """The musubi format for family qwen-image: musubi-tuner's ``qi`` cache directory and its dataset config."""

    keys: ClassVar[dict[str, str]] = {"latents": "latents", "text_embeddings": "vl_embed"}

    def writer(self, out: Path) -> MusubiQiWriter:
        return MusubiQiWriter(out, self)

    def stored_dtype(self, kind: str, store_dtype: str) -> torch.dtype:
        return torch.bfloat16

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        """The caption file's exact name; the latents file's without the image's size (taken from the image)."""
        latents = f"{flat_name(stem)}_{ARCHITECTURE}.safetensors"
        return {k: text_name(stem) if k == "text_embeddings" else latents for k in kinds}

    def check_out(self, out: Path, source: str) -> None:
        if outdir.is_store(out):
            super().check_out(out, source)  # refused: its dataset config names a local folder
        check_cache_directory(Path(out), source, f"_{ARCHITECTURE}.safetensors")
