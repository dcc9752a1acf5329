"""FastVideo's ``pyarrow_schema_t2va`` (video, stereo audio and text of one clip in one row), what its
``preprocess_minimax_h3_overfit.py`` writes for MiniMax-H3 and its ``MiniMaxH3Model`` trains on (the ``fastvideo``
0.2.1 package: ``fastvideo/dataset/dataloader/schema.py``, ``build_parquet_record``).

Columns: the t2v schema's tensors (``vae_latent``, ``text_embedding``) with ``audio_latent_bytes/shape/dtype``
between them, then ``file_name``, ``caption``, ``media_type`` (``video_with_audio``), ``width``, ``height``,
``num_frames``, ``duration_sec``, ``fps``, ``audio_sample_rate``. Its collate reads every tensor's bytes as float32
(``vae_latent`` [24, F', H', W'], ``audio_latent`` [2, 32, T], ``text_embedding`` [L, 5120] unpadded: it pads to
``text_len`` with zeros and a mask).

A clip without audio (its row records the track missing: the same rule as LTX-2's, `infra.preprocess.encode`) has
empty ``audio_latent`` bytes and shape ``[]``: FastVideo's own preprocessing refuses such a clip ("requires a
soundtrack") and its trainer refuses the row, so reconciliation counts it short and the loss gate decides.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch

from infra.formats.base import AUDIO_KIND, EncodedSample

SCHEMA_T2VA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("vae_latent_bytes", pa.binary()),
        pa.field("vae_latent_shape", pa.list_(pa.int64())),
        pa.field("vae_latent_dtype", pa.string()),
        pa.field("audio_latent_bytes", pa.binary()),
        pa.field("audio_latent_shape", pa.list_(pa.int64())),
        pa.field("audio_latent_dtype", pa.string()),
        pa.field("text_embedding_bytes", pa.binary()),
        pa.field("text_embedding_shape", pa.list_(pa.int64())),
        pa.field("text_embedding_dtype", pa.string()),
        pa.field("file_name", pa.string()),
        pa.field("caption", pa.string()),
        pa.field("media_type", pa.string()),
        pa.field("width", pa.int64()),
        pa.field("height", pa.int64()),
        pa.field("num_frames", pa.int64()),
        pa.field("duration_sec", pa.float64()),
        pa.field("fps", pa.float64()),
        pa.field("audio_sample_rate", pa.int64()),
    ]
)
#: The rate its audio latents were made at (its ``AUDIO_SAMPLE_RATE``: the H3 audio VAE's).
AUDIO_SAMPLE_RATE = 32000
MEDIA_TYPE = "video_with_audio"


def audio_columns(sample: EncodedSample, to_bytes: Any, dtype: torch.dtype, name: str) -> dict[str, Any]:
    """The row's ``audio_latent`` columns and what differs from a t2v row (`to_bytes`: the format's tensor →
    bytes in `dtype`, named `name` in the dtype column)."""
    audio = sample.extras.get(AUDIO_KIND)
    present = isinstance(audio, torch.Tensor)
    return {
        "audio_latent_bytes": to_bytes(audio, dtype) if present else b"",
        "audio_latent_shape": list(audio.shape) if present else [],
        "audio_latent_dtype": name,
        "media_type": MEDIA_TYPE,
        "audio_sample_rate": AUDIO_SAMPLE_RATE,
    }
