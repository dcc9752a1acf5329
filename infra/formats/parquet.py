"""The parquet format: FastVideo's t2v schema exactly, ``OUT/shards/<shard-id>-<part:05d>.parquet``.

Columns (FastVideo's ``pyarrow_schema_t2v``): ``id``, ``vae_latent_bytes/shape/dtype``,
``text_embedding_bytes/shape/dtype``, ``file_name``, ``caption``, ``media_type``, ``width``, ``height``,
``num_frames`` (int64), ``duration_sec``, ``fps`` (float64); shapes ``list<int64>``.

* FastVideo's reader ignores the ``*_dtype`` columns and always decodes float32, so tensor bytes are float32 by
  default (``--parquet-dtype bf16|fp16`` for readers that honour the column);
* the rows are what FastVideo's own preprocessing stores (`infra.formats.consumers`): Wan2.2 latents as the raw
  posterior mean (its WanModel normalises at training time) and the text trimmed to the prompt's tokens,
  ``[seq_len, D]`` (its collate pads it back with zeros and a mask); LTX-2 post-connector text with all its rows
  (the connector's registers fill the padding; LTX2Model passes no mask); ``fps`` and ``duration_sec`` the rate and
  length of the frames stored;
* zstd, row groups of at most `ROW_GROUP_ROWS` rows or `ROW_GROUP_BYTES` bytes (streamed one at a time);
* the file's key-value metadata holds ``latentforge.fingerprint``, the dtypes the tensors were made in
  (latentforge's reader gives them back in those: bf16 widened to float32 and back is exact), and
  ``latentforge.consumer``: whom the rows are for and what it sees (each record read back says it too).

Audio latents have no column in this schema: a family whose consumer collates FastVideo's ``pyarrow_schema_t2va``
(h3) is written in that one (`infra.formats.parquet_t2va`); another family's audio is refused at the plan.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from infra.formats.base import AUDIO_KIND, EncodedSample, opened
from infra.formats.consumer_glob import ConsumerGlob
from infra.formats.consumers import AUDIO_SCHEMA, expects, stored_fps
from infra.formats.parquet_t2va import SCHEMA_T2VA, audio_columns
from infra.formats.shards import ShardFormat, ShardWriter, Sink, shard_options
from infra.outdir import OutFile

SCHEMA_T2V = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("vae_latent_bytes", pa.binary()),
        pa.field("vae_latent_shape", pa.list_(pa.int64())),
        pa.field("vae_latent_dtype", pa.string()),
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
    ]
)
FINGERPRINT_KEY = "latentforge.fingerprint"
DTYPES_KEY = "latentforge.dtypes"
CONSUMER_KEY = "latentforge.consumer"
ROW_GROUP_ROWS = 256
ROW_GROUP_BYTES = 64 << 20
#: --parquet-dtype → (torch dtype, the name in the *_dtype column).
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "float32"),
    "bf16": (torch.bfloat16, "bfloat16"),
    "fp16": (torch.float16, "float16"),
}


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    """C-order bytes of `tensor` in `dtype` (bf16 as its 16-bit patterns)."""
    value = tensor.detach().cpu().to(dtype).contiguous()
    if dtype == torch.bfloat16:
        value = value.view(torch.int16)
    return value.numpy().tobytes()


def from_bytes(data: bytes, shape: list[int], dtype: str) -> torch.Tensor:
    """A tensor from a row's bytes, shape and dtype column."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype)).copy()).reshape(shape)


def to_row(sample: EncodedSample, dtype: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One sample as a row of the t2v schema, as FastVideo's preprocessing of the spec's family writes it
    (`options`: the spec's ``family`` and ``temporal``; none: a Wan-like row)."""
    options = options or {}
    torch_dtype, name = DTYPES[dtype]
    geometry = list(sample.info.get("geometry") or [])
    frames, height, width = ([1, *geometry] if len(geometry) == 2 else geometry) or [0, 0, 0]
    fps = stored_fps(options.get("temporal"), sample.info)
    found = expects("parquet", str(options.get("family")))
    all_rows = found is not None and found.text_rows == "all"
    text = sample.text_embeds if all_rows else sample.text_embeds[: int(sample.seq_len)]
    row = {
        "id": sample.stem,
        "vae_latent_bytes": tensor_bytes(sample.latents, torch_dtype),
        "vae_latent_shape": list(sample.latents.shape),
        "vae_latent_dtype": name,
        "text_embedding_bytes": tensor_bytes(text, torch_dtype),
        "text_embedding_shape": list(text.shape),
        "text_embedding_dtype": name,
        "file_name": sample.id,
        "caption": sample.prompt,
        "media_type": "image" if frames <= 1 else "video",
        "width": int(width),
        "height": int(height),
        "num_frames": int(frames),
        "duration_sec": frames / fps if fps else 0.0,
        "fps": fps,
    }
    return row | (audio_columns(sample, tensor_bytes, torch_dtype, name) if schema_of(options) is SCHEMA_T2VA else {})


def schema_of(options: dict[str, Any]) -> pa.Schema:
    """The schema the spec's family's consumer collates (`infra.formats.consumers.Expects.parquet_schema`)."""
    found = expects("parquet", str(options.get("family")))
    return SCHEMA_T2VA if found is not None and found.parquet_schema == AUDIO_SCHEMA else SCHEMA_T2V


class ParquetWriter(ShardWriter):
    """Streams samples into parquet parts, a row group at a time."""

    ext = "parquet"

    def begin(self, sink: Sink, sample: EncodedSample) -> None:
        made_in = {"latents": str(sample.latents.dtype), "text_embeddings": str(sample.text_embeds.dtype)}
        if isinstance(audio := sample.extras.get(AUDIO_KIND), torch.Tensor):
            made_in[AUDIO_KIND] = str(audio.dtype)
        metadata = {
            FINGERPRINT_KEY: sample.fingerprint,
            DTYPES_KEY: json.dumps(made_in, sort_keys=True),
            CONSUMER_KEY: json.dumps(consumer_facts(self.options), sort_keys=True),
        }
        self._pq = pq.ParquetWriter(
            pa.PythonFile(sink, mode="w"), schema_of(self.options).with_metadata(metadata), compression="zstd"
        )
        self._rows: list[dict[str, Any]] = []
        self._buffered = 0

    def add(self, sample: EncodedSample) -> tuple[str, int, str]:
        row = to_row(sample, self.options.get("parquet_dtype") or "fp32", self.options)
        self._rows.append(row)
        tensors = row["vae_latent_bytes"] + row.get("audio_latent_bytes", b"") + row["text_embedding_bytes"]
        size = len(tensors)
        self._buffered += size
        if len(self._rows) >= ROW_GROUP_ROWS or self._buffered >= ROW_GROUP_BYTES:
            self._flush()
        digest = hashlib.sha256(tensors)
        return row["id"], size, digest.hexdigest()

    def size(self) -> int:
        return super().size() + self._buffered

    def _flush(self) -> None:
        if self._rows:
            self._pq.write_table(pa.Table.from_pylist(self._rows, schema=self._pq.schema))
        self._rows, self._buffered = [], 0

    def end(self) -> None:
        self._flush()
        self._pq.close()


def consumer_facts(options: dict[str, Any]) -> dict[str, Any]:
    """Whom a part's rows are for and what it sees of them (the part's ``latentforge.consumer`` metadata)."""
    found = expects("parquet", str(options.get("family")))
    if found is None:
        return {"consumer": "latentforge's readers"}
    return {
        "consumer": found.consumer,
        "latents": found.latents,
        "text_rows": found.text_rows,
        "text_stage": found.text_stage,
        "fps": found.fps,
    }


class ParquetFormat(ShardFormat):
    """FastVideo's parquet (t2v schema)."""

    name = "parquet"
    ext = "parquet"
    keys: ClassVar[dict[str, str]] = {
        "latents": "latents",
        "text_embeddings": "text_embeddings",
        AUDIO_KIND: AUDIO_KIND,  # the t2va schema's (h3); refused at the plan for a family read through t2v
    }
    #: FastVideo's parquet datasets (``os.walk`` of the data path): every name ending ``.parquet`` below it.
    consumer_glob = ConsumerGlob(("**/*.parquet",))

    def trims_text_for(self, family: str) -> bool:
        found = expects(self.name, family)
        return found is None or found.text_rows == "prompt"

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> ParquetWriter:
        options = {
            **shard_options(spec),
            "family": getattr(spec, "family", None),
            "temporal": getattr(spec, "temporal", None),
        }
        return ParquetWriter(out, self, shard_id, options)

    def _records(self, table: pa.Table, metadata: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
        made_in = json.loads(metadata.get(DTYPES_KEY.encode(), b"{}"))
        fingerprint = metadata.get(FINGERPRINT_KEY.encode(), b"").decode()
        consumer = json.loads(metadata.get(CONSUMER_KEY.encode(), b"{}"))
        records = {}
        for row in table.to_pylist():
            latents = from_bytes(row["vae_latent_bytes"], row["vae_latent_shape"], row["vae_latent_dtype"])
            text = from_bytes(row["text_embedding_bytes"], row["text_embedding_shape"], row["text_embedding_dtype"])
            back = {k: getattr(torch, v.removeprefix("torch.")) for k, v in made_in.items()}
            audio = {}
            if row.get("audio_latent_bytes"):  # a t2va row with audio (h3)
                value = from_bytes(row["audio_latent_bytes"], row["audio_latent_shape"], row["audio_latent_dtype"])
                audio = {AUDIO_KIND: value.to(back.get(AUDIO_KIND, value.dtype))}
            records[row["id"]] = audio | {
                "latents": latents.to(back.get("latents", latents.dtype)),
                "text_embeddings": text.to(back.get("text_embeddings", text.dtype)),
                "prompt": row["caption"],
                "fingerprint": fingerprint,
                "seq_len": int(row["text_embedding_shape"][0]),
                "consumer": consumer,
                **{
                    k: row[k]
                    for k in ("id", "file_name", "media_type", "width", "height", "num_frames", "fps", "duration_sec")
                },
            }
        return records

    def read_part(self, path: Path | OutFile) -> dict[str, dict[str, Any]]:
        with opened(path) as fh:
            file = pq.ParquetFile(fh)
            return self._records(file.read(), file.schema_arrow.metadata or {})

    def read_member(self, path: Path | OutFile, member: str) -> dict[str, Any]:
        with opened(path) as fh:
            table = pq.read_table(fh, filters=[("id", "=", member)])
        found = self._records(table, table.schema.metadata or {})
        if member not in found:
            raise KeyError(f"{path}: no sample {member!r}")
        return found[member]

    def copy_without(self, path: Path | OutFile, sink: Sink, drop: set[str]) -> list[str]:
        kept: list[str] = []
        with opened(path) as fh:
            source = pq.ParquetFile(fh)
            with pq.ParquetWriter(pa.PythonFile(sink, mode="w"), source.schema_arrow, compression="zstd") as writer:
                for group in range(source.num_row_groups):  # a row group at a time, as the writer made them
                    table = source.read_row_group(group)
                    table = table.filter(pc.invert(pc.is_in(table["id"], pa.array(sorted(drop), pa.string()))))
                    if table.num_rows:
                        writer.write_table(table)
                        kept.extend(table["id"].to_pylist())
        return kept

    def fingerprints(self, path: Path | OutFile) -> set[str]:
        with opened(path) as fh:
            metadata = pq.read_schema(fh).metadata or {}
        return {metadata.get(FINGERPRINT_KEY.encode(), b"").decode()}
