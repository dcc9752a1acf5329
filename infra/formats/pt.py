"""Per-sample ``.pt`` (the Wan/VBVR layout): ``OUT/<group>/<id>.pt``.

Each file is a plain dict of tensors, strings, ints and lists, so it loads with
``torch.load(weights_only=True)``: no pickled code, ever.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.formats.base import EncodedSample, Format, PerSampleWriter, opened
from infra.formats.consumer_glob import ConsumerGlob
from infra.outdir import OutFile


def to_record(sample: EncodedSample) -> dict[str, Any]:
    """The stored dict."""
    text = {"text_embeds": sample.text_embeds.contiguous()} if sample.text_embeds is not None else {}
    record: dict[str, Any] = {
        "x0": sample.latents.contiguous(),
        **text,  # absent for a family without a text encoder (the prompt is stored as text only)
        "prompt": sample.prompt,
        "source_shape": list(sample.source_shape),
        "latent_shape": sample.latent_shape,
        "seq_len": int(sample.seq_len),
        "fingerprint": sample.fingerprint,
        "id": sample.id,
        "group": sample.group,
    }
    record.update(sample.extras)
    return record


def relpath(stem: str) -> str:
    """OUT-relative path of one sample: ``<group>/<id>.pt`` for a VBVR source."""
    return f"{stem}.pt"


def serialize(sample: EncodedSample) -> bytes:
    """torch.save into memory: hashed and written in one go, no second read."""
    buffer = io.BytesIO()
    torch.save(to_record(sample), buffer)
    return buffer.getvalue()


class PtWriter(PerSampleWriter):
    """Writes OUT/<group>/<id>.pt atomically: one file holds every output kind."""

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        return [([], relpath(sample.stem), serialize(sample))]


class PtFormat(Format):
    """The pt format: writer, path rule and reader."""

    name = "pt"
    keys: ClassVar[dict[str, str]] = {
        "latents": "x0",
        "text_embeddings": "text_embeds",
        "audio_latents": "audio_latents",
        "image_latents": "image_latents",  # --mode i2v: `infra.models.base.ImageConditioning`
        "clip_features": "clip_features",
        "first_frame_latents": "first_frame_latents",
    }
    #: What a trainer of the VBVR cache loads: every ``.pt`` below OUT (``OUT/<group>/<id>.pt``, nested stems kept).
    consumer_glob = ConsumerGlob(("**/*.pt",))

    def writer(self, out: Path) -> PtWriter:
        return PtWriter(out, self)

    has_fingerprint = True

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        return dict.fromkeys(kinds, relpath(stem))

    def read(self, path: Path | OutFile) -> dict[str, Any]:
        with opened(path) as fh:
            return torch.load(fh, map_location="cpu", weights_only=True)
