"""The Writer / Reader contract and the format registry.

A writer is a context manager with `write(sample)`; every format has a reader, and every writer is
tested by a round trip through its reader.
"""

from __future__ import annotations

import hashlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import torch

from infra import outdir
from infra.cache.ledger import FileRecord
from infra.formats.consumer_glob import ConsumerGlob
from infra.models.base import ROLES
from infra.outdir import OutFile
from infra.storage import Written, atomic_write

#: The output kind a family with audio adds (LTX-2): its tensor travels in ``EncodedSample.extras``.
AUDIO_KIND = ROLES["audio"]
#: The kinds of the other roles a family's modes read (`infra.models.base.ROLES`), also in ``EncodedSample.extras``:
#: an IC-LoRA sample's reference video and audio latents, an inpainting sample's masks.
REFERENCE_KIND = ROLES["reference_video"]
REFERENCE_AUDIO_KIND = ROLES["reference_audio"]
VIDEO_MASK_KIND = ROLES["video_mask"]
AUDIO_MASK_KIND = ROLES["audio_mask"]
#: An image-to-video sample's conditioning (`infra.models.base.ImageConditioning`, ``--mode i2v``): Wan I2V's ``y``
#: (mask + first-frame latents), its CLIP features, TI2V-5B's first latent frame.
IMAGE_LATENTS_KIND = "image_latents"
CLIP_KIND = "clip_features"
FIRST_FRAME_KIND = "first_frame_latents"
#: HunyuanVideo 1.5's ByT5 rows of a prompt's quoted text (`infra.models.hv15`): float16, as musubi's ByT5 runs.
GLYPH_KIND = "glyph_embeddings"
#: The dtype each output kind is stored in (the LTX-2 trainer keeps audio latents and masks in float32).
KIND_DTYPES: dict[str, torch.dtype] = {
    "latents": torch.bfloat16,
    "text_embeddings": torch.bfloat16,
    AUDIO_KIND: torch.float32,
    REFERENCE_KIND: torch.bfloat16,
    REFERENCE_AUDIO_KIND: torch.float32,
    VIDEO_MASK_KIND: torch.float32,
    AUDIO_MASK_KIND: torch.float32,
    IMAGE_LATENTS_KIND: torch.bfloat16,
    CLIP_KIND: torch.float16,  # musubi-tuner's clip_float16 (its CLIP runs in float16)
    FIRST_FRAME_KIND: torch.bfloat16,
    GLYPH_KIND: torch.float16,
}
#: The kinds stored in ``--store-dtype`` (the others keep their `KIND_DTYPES`).
STORED_AS_SPEC = ("latents", "text_embeddings", REFERENCE_KIND, IMAGE_LATENTS_KIND, FIRST_FRAME_KIND)
#: ``--store-dtype`` → the dtype of the latents and text embeddings (audio latents stay float32).
STORE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kind_dtype(kind: str, store_dtype: str = "bf16") -> torch.dtype:
    """The dtype an output kind is stored in under a spec's ``store_dtype``."""
    return STORE_DTYPES[store_dtype] if kind in STORED_AS_SPEC else KIND_DTYPES[kind]


@dataclass
class EncodedSample:
    """One sample, encoded: what every writer receives."""

    id: str
    group: str
    stem: str  # OUT-relative name of its outputs, without a suffix (mirrors the source: ``group/id``, ``dir/clip``)
    prompt: str
    latents: torch.Tensor | None  # (C, F', H', W') bf16 (image family: (C, H', W')); None: an audio-only sample
    text_embeds: torch.Tensor | None  # (max_length, D) bf16; None: a family without a text encoder
    seq_len: int
    source_shape: list[int]  # [T, H, W, C]
    fingerprint: str
    extras: dict[str, Any] = field(default_factory=dict)  # more to store: the family's (masks, audio latents)
    info: dict[str, Any] = field(default_factory=dict)  # facts a format may store: fps, frames, audio_duration

    @property
    def latent_shape(self) -> list[int] | None:
        return list(self.latents.shape) if self.latents is not None else None

    def outputs(self) -> dict[str, torch.Tensor]:
        """Each output kind's tensor: latents, text_embeddings, and those of the other kinds the sample has (audio
        latents where it has audio, a reference's latents, masks)."""
        extra = {kind: t for kind in KIND_DTYPES if isinstance(t := self.extras.get(kind), torch.Tensor)}
        text = {"text_embeddings": self.text_embeds} if self.text_embeds is not None else {}
        video = {"latents": self.latents} if self.latents is not None else {}
        return {**video, **text, **extra}


@dataclass(frozen=True)
class WrittenSample:
    """What a writer put on disk for one sample: each file with the output kinds it holds."""

    files: list[tuple[list[str], Written]]
    member: str | None = None  # the sample's key inside its file (shard formats: `Written` is the sample's bytes)

    def records(self, out: Path) -> list[FileRecord]:
        """The ledger's records of the files (paths relative to OUT)."""
        return [
            FileRecord(
                path=w.path.relative_to(out).as_posix(), bytes=w.bytes, sha256=w.sha256, kinds=kinds, member=self.member
            )
            for kinds, w in self.files
        ]


class Writer(ABC):
    """Writes encoded samples under OUT, as a context manager (`close` on exit finishes what is open).
    `replace` allows replacing an existing file (an approved overwrite)."""

    def __init__(self, out: Path, fmt: Format) -> None:
        self.out = outdir.root(out)
        self.format = fmt

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - a hook: per-sample formats have nothing to finish
        """Finish what is open (a shard file, say)."""

    @abstractmethod
    def write(self, sample: EncodedSample, *, replace: bool = False) -> WrittenSample:
        """Write one sample's files atomically; FileExistsError if one exists and not `replace`."""


class PerSampleWriter(Writer):
    """A writer of one or more files per sample (pt, the LTX-2 trainer's layout): `render` makes their bytes,
    `write` puts each in place atomically. Rendering without writing lets a rerun tell whether a file left by
    an interrupted run is exactly what this run would write."""

    @abstractmethod
    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        """(output kinds, OUT-relative path, bytes) of each file of the sample ([] kinds: every kind)."""

    def write(self, sample: EncodedSample, *, replace: bool = False) -> WrittenSample:
        return self.write_rendered(self.render(sample), replace=replace)

    def write_rendered(
        self, files: list[tuple[list[str], str, bytes]], *, replace: bool = False, present: frozenset[str] = frozenset()
    ) -> WrittenSample:
        """Write rendered files; those in `present` are already on disk with exactly these bytes: left as they are."""
        written = []
        for kinds, rel, data in files:
            if rel in present:
                written.append((kinds, Written(self.out / rel, len(data), hashlib.sha256(data).hexdigest())))
            else:
                written.append((kinds, atomic_write(rel, data, replace=replace, out=self.out)))
        return WrittenSample(written)


class Format(ABC):
    """A cache format: its writer, its path rule and its reader; every writer round-trips through its reader."""

    name: ClassVar[str]
    #: Output kind → the key that holds it in a record `read` returns (x0, text_embeds, ...).
    keys: ClassVar[dict[str, str]]
    #: The files of OUT the format's consumer loads, by the consumer's own glob (docs/formats.md): verify, reconcile,
    #: inspect and a resume name those no ledger row owns (`infra.gates.unowned`).
    consumer_glob: ClassVar[ConsumerGlob]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = ("name", "keys", "consumer_glob")
        missing = [a for a in declared if not inspect.isabstract(cls) and not hasattr(cls, a)]
        if missing:
            raise TypeError(f"format {cls.__name__} does not declare {', '.join(missing)}")

    def for_family(self, family: str | None) -> Format:
        """This format as it lays out `family`'s samples: itself, or, where its consumer names and keys a family's
        files its own way (musubi-tuner's ``qi`` files, DiffSynth's Qwen-Image inputs), the format object for that
        family (same name, its own writer, paths, keys and reader). None: the format's own layout."""
        return self

    def keys_for(self, family: str | None) -> dict[str, str]:
        """`keys` as the format stores `family`'s samples (its `for_family` object's; musubi's hv15 files: its own)."""
        return self.for_family(family).keys

    def label(self, kind: str, family: str | None = None) -> str:
        """What a report calls an output kind: its key (x0, text_embeds), or the kind where keys repeat across
        files (the LTX-2 layout's ``latents`` holds video in one file and audio in another)."""
        keys = self.keys_for(family)
        key = keys[kind]
        return kind if sum(k == key for k in keys.values()) > 1 and kind != "latents" else key

    def load_outputs(self, out: Path, paths: dict[str, str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Read back a sample's files (kind → OUT-relative path) safely: (kind → the value under the format's key
        for it, None when absent; path → the whole record). Raises what `read` raises for a damaged file."""
        records: dict[str, dict[str, Any]] = {}
        values: dict[str, Any] = {}
        for kind, relpath in paths.items():
            if relpath not in records:
                records[relpath] = self.read(OutFile(outdir.root(out), relpath))
            record = records[relpath]
            values[kind] = record.get(self.keys[kind]) if isinstance(record, dict) and kind in self.keys else None
        return values, records

    @abstractmethod
    def writer(self, out: Path) -> Writer:
        """A writer of samples under OUT."""

    #: True for formats that keep many samples per file (webdataset, parquet: `infra.formats.shards`).
    sharded: ClassVar[bool] = False

    def trims_text_for(self, family: str) -> bool:
        """True when this format stores `family`'s text embedding trimmed to the prompt's tokens ([seq_len, D]: what
        FastVideo's Wan preprocessing stores), as its consumer reads it (`infra.formats.consumers`)."""
        return False

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> Writer:
        """The writer the shard loop uses for source shard `shard_id` under the cache spec `spec` (a CacheSpec, or
        None for defaults); per-sample formats need neither."""
        return self.writer(out)

    def present(self, out: Path, file: FileRecord) -> bool:
        """Whether a ledger's file record is whole on disk (a per-sample file: there, at the ledger's size)."""
        return outdir.size(out, file.path) == file.bytes

    def read_file(self, out: Path, file: FileRecord) -> dict[str, Any]:
        """Load what a ledger's file record names (a whole file, or a member of a shard file) safely, through the
        door to OUT (`infra.outdir`: a link or a path outside OUT is refused)."""
        return self.read(OutFile(outdir.root(out), file.path))

    @abstractmethod
    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        """OUT-relative path of the file holding each output kind of the sample named `stem` (kinds may share
        one file): deterministic, mirroring the source's names."""

    def sample_file(self, stem: str, kinds: Iterable[str], rel: str) -> bool:
        """Whether OUT-relative `rel` is a file the sample named `stem` writes (one of its `paths`; a format whose names
        take more than the stem says so itself)."""
        return rel in self.paths(stem, kinds).values()

    def stored_dtype(self, kind: str, store_dtype: str) -> torch.dtype:
        """The dtype this format stores an output kind in (default `kind_dtype`; a consumer's own may differ)."""
        return kind_dtype(kind, store_dtype)

    def derived_buckets(self, config: Any, temporal: str) -> list[Any] | None:
        """The buckets a format whose consumer recomputes them from the resolution derives from the config's
        ``width``/``height``/``frames`` (the spec keeps those as given), or None: the config's own ``--buckets``."""
        return None

    def check_out(self, out: Path, source: str) -> None:  # noqa: B027 - a hook: most formats share OUT freely
        """ConfigError when OUT cannot take this source's samples as the format's consumer reads them (musubi: one
        dataset per cache directory)."""

    #: True when `read` returns the cache's fingerprint under the key ``fingerprint`` (a file of another run can
    #: be told apart without re-encoding); formats that store exactly a trainer's keys have none.
    has_fingerprint: ClassVar[bool] = False

    @abstractmethod
    def read(self, path: Path | OutFile) -> dict[str, Any]:
        """Load one stored sample safely (no pickled code: ``weights_only=True`` or safetensors): a file named by
        the caller, or a file below OUT opened through the door (`OutFile`)."""


def opened(path: Path | OutFile) -> BinaryIO:
    """`path` open for reading: a file below OUT through the door, any other as named."""
    return path.open() if isinstance(path, OutFile) else Path(path).open("rb")
