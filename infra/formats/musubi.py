"""musubi-tuner's Wan latent cache, ``musubi``: OUT is the dataset's flat ``cache_directory``.

Restated from kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7
(``src/musubi_tuner/dataset/cache_io.py`` ``save_latent_cache_wan`` / ``save_text_encoder_output_cache_wan``,
``dataset/image_video_dataset.py`` ``get_latent_cache_path`` / ``prepare_for_training``, ``dataset/bucket.py``):

* a clip's latents: ``{name}_{start:05d}-{F:03d}_{W:04d}x{H:04d}_wan.safetensors``, W×H the bucket's size, as its
  video caching names a clip (``VideoDataset.retrieve_latent_cache_batches``: ``load_video`` hands back frames
  already resized to the bucket, and their size is the item's ``original_size``); a one-frame sample:
  ``{name}_{W:04d}x{H:04d}_wan.safetensors``, W×H the source's size, as its image datasets name an image
  (``ImageDataset``: the size before ``resize_image_to_bucket``); its loader recomputes the bucket from either
  (a bucket's own size gives that bucket); keys ``latents_{F'}x{H'}x{W'}_bfloat16`` [16, F', H', W']
  (normalised), for I2V ``latents_image_{F'}x{H'}x{W'}_bfloat16`` [20, F', H', W'] and, with a CLIP,
  ``clip_bfloat16`` [257, 1280] float16 (its key takes the latents' dtype name); metadata ``architecture=wan``,
  ``width`` and ``height`` (the size the name gives), ``frame_count``, ``format_version=1.0.1``;
* the text: ``{name}_wan_te.safetensors``, ``varlen_t5_bfloat16`` [L, 4096]: UMT5's rows of the prompt's tokens;
  metadata ``architecture=wan``, ``caption1`` (the caption), ``format_version``.

``name`` is the sample's stem made flat (its loader takes the file's base name): ``%`` and ``/`` are written
``%25`` and ``%2F``, so two stems never meet. Every file's metadata also holds ``latentforge_fingerprint``,
``latentforge_group`` and ``latentforge_id`` (musubi reads no metadata of these files). ``musubi_dataset.toml``
beside them is the dataset config that trains on them.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load

from infra import outdir
from infra.errors import ConfigError
from infra.formats import musubi_hv15
from infra.formats.base import (
    CLIP_KIND,
    GLYPH_KIND,
    IMAGE_LATENTS_KIND,
    EncodedSample,
    Format,
    PerSampleWriter,
    WrittenSample,
    opened,
)
from infra.formats.consumer_glob import ConsumerGlob
from infra.formats.musubi_toml import TOML_NAME, check_cache_directory, write_toml
from infra.formats.safetensors_bytes import safetensors_bytes
from infra.media.buckets import Bucket, musubi_buckets, parse_buckets
from infra.outdir import OutFile

ARCHITECTURE = "wan"
#: A family's musubi architecture code (its files' suffix) and full name (their ``architecture`` metadata), where it
#: is not Wan's: `infra.formats.musubi_hv15` says what goes in HunyuanVideo 1.5's files.
CODES = {"hv15": musubi_hv15.CODE}
FULL_NAMES = {"hv15": musubi_hv15.FULL_NAME}
FORMAT_VERSION = "1.0.1"
FINGERPRINT_KEY = "latentforge_fingerprint"
#: What else a file carries for the resume to tell it is this sample's (`infra.preprocess.resume`).
GROUP_KEY, ID_KEY = "latentforge_group", "latentforge_id"
LATENT_KINDS = ("latents", IMAGE_LATENTS_KIND, CLIP_KIND)
#: torch's names of dtypes, as musubi's ``dtype_to_str`` writes them at the end of a key.
_DTYPES = {str(d).removeprefix("torch.") for d in (torch.bfloat16, torch.float16, torch.float32, torch.int32)}
_SHAPE = re.compile(r"_\d+x\d+x\d+$")


def flat_name(stem: str) -> str:
    """The sample's stem as one file name (reversible: ``%`` → ``%25``, ``/`` → ``%2F``)."""
    return stem.replace("%", "%25").replace("/", "%2F")


def latent_name(stem: str, start: int, frames: int, width: int, height: int, code: str = ARCHITECTURE) -> str:
    """The latents file's name, as musubi's ``get_latent_cache_path`` makes it (`code`: the architecture's)."""
    if frames == 1:  # an image dataset's item: no frame range
        return f"{flat_name(stem)}_{width:04d}x{height:04d}_{code}.safetensors"
    return f"{flat_name(stem)}_{start:05d}-{frames:03d}_{width:04d}x{height:04d}_{code}.safetensors"


def text_name(stem: str, code: str = ARCHITECTURE) -> str:
    return f"{flat_name(stem)}_{code}_te.safetensors"


def code_of(family: str | None) -> str:
    """The musubi architecture code of `family`'s files (Wan's for wan21)."""
    return CODES.get(family or "", ARCHITECTURE)


def content_key(key: str) -> str:
    """A stored key as musubi's ``BucketBatchManager`` names it in a batch: ``varlen_`` and the dtype dropped, and a
    latent's FxHxW (``latents_image_5x6x10_bfloat16`` → ``latents_image``)."""
    key = key.removeprefix("varlen_")
    head, _, tail = key.rpartition("_")
    key = head if tail in _DTYPES else key
    return _SHAPE.sub("", key) if key.startswith("latents_") else key


def _marks(sample: EncodedSample) -> dict[str, str]:
    return {FINGERPRINT_KEY: sample.fingerprint, GROUP_KEY: sample.group, ID_KEY: sample.id}


def _named_size(sample: EncodedSample) -> tuple[int, int, int]:
    """(frames, width, height) a latents file is named by: a clip's bucket (its frames' size after musubi's resize),
    a one-frame sample's source size (an image dataset's item keeps its image's)."""
    frames, height, width = sample.info["geometry"]
    if frames == 1:
        _, height, width, _ = sample.source_shape
    return int(frames), int(width), int(height)


def _wan_latents(sample: EncodedSample) -> dict[str, torch.Tensor]:
    latents = sample.latents
    assert latents is not None
    _, f, h, w = latents.shape
    tensors = {f"latents_{f}x{h}x{w}_bfloat16": latents.to(torch.bfloat16).contiguous()}
    if isinstance(y := sample.extras.get(IMAGE_LATENTS_KIND), torch.Tensor):
        tensors[f"latents_image_{f}x{h}x{w}_bfloat16"] = y.to(torch.bfloat16).contiguous()
    if isinstance(clip := sample.extras.get(CLIP_KIND), torch.Tensor):
        tensors["clip_bfloat16"] = clip.to(torch.float16).contiguous()  # musubi's key: the latents' dtype name
    return tensors


def _wan_text(sample: EncodedSample) -> dict[str, torch.Tensor]:
    assert sample.text_embeds is not None
    return {"varlen_t5_bfloat16": sample.text_embeds[: sample.seq_len].to(torch.bfloat16).contiguous()}


def _latents(sample: EncodedSample, family: str | None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = musubi_hv15.latent_tensors(sample) if family == "hv15" else _wan_latents(sample)
    frames, width, height = _named_size(sample)
    architecture = FULL_NAMES.get(family or "", ARCHITECTURE)
    metadata = {"architecture": architecture, "width": str(width), "height": str(height)}
    metadata |= {"format_version": FORMAT_VERSION} | _marks(sample)
    if frames > 1:
        metadata["frame_count"] = str(frames)
    return tensors, metadata


def render(sample: EncodedSample, family: str | None = None) -> list[tuple[list[str], str, bytes]]:
    """(kinds, OUT-relative path, bytes) of the sample's latents file and its text file, as musubi caches `family`
    (wan21 when None)."""
    tensors, metadata = _latents(sample, family)
    frames, width, height = _named_size(sample)
    start = int((sample.info.get("sampling") or {}).get("indices", [0])[0])
    kinds = [kind for kind in LATENT_KINDS if kind == "latents" or kind in sample.extras]
    text = musubi_hv15.text_tensors(sample) if family == "hv15" else _wan_text(sample)
    text_kinds = ["text_embeddings", *([GLYPH_KIND] if GLYPH_KIND in sample.extras else [])]
    caption = {"architecture": metadata["architecture"], "caption1": sample.prompt, "format_version": FORMAT_VERSION}
    caption |= _marks(sample)
    code = code_of(family)
    return [
        (kinds, latent_name(sample.stem, start, frames, width, height, code), safetensors_bytes(tensors, metadata)),
        (text_kinds, text_name(sample.stem, code), safetensors_bytes(text, caption)),
    ]


class MusubiWriter(PerSampleWriter):
    """Writes a sample's two files. A file already at a name with exactly these bytes (left by an interrupted run of
    this spec: the name depends on the clip's bucket, so the resume cannot know it before the sample is read) is
    kept; one with other bytes is not overwritten unless `replace`."""

    def __init__(self, out: Path, fmt: Format, family: str | None = None) -> None:
        super().__init__(out, fmt)
        self.family = family

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        return render(sample, self.family)

    def write(self, sample: EncodedSample, *, replace: bool = False) -> WrittenSample:
        rendered = self.render(sample)
        present = {rel for _, rel, data in rendered if _same(self.out, rel, data)}
        return self.write_rendered(rendered, replace=replace, present=frozenset(present))


def _same(out: Path, rel: str, data: bytes) -> bool:
    """Whether the file at `rel` below OUT holds exactly `data` (read through the door)."""
    return outdir.size(out, rel) == len(data) and outdir.read_bytes(out, rel) == data


class MusubiFormat(Format):
    """The musubi format: musubi-tuner's Wan cache directory and its dataset config."""

    name = "musubi"
    #: Output kind → the key musubi's loader gives it in a batch (`content_key`).
    keys: ClassVar[dict[str, str]] = {
        "latents": "latents",
        "text_embeddings": "t5",
        IMAGE_LATENTS_KIND: "latents_image",
        CLIP_KIND: "clip",
    }
    has_fingerprint = True
    #: Its ``prepare_for_training``: ``glob(cache_directory/*_wan.safetensors)`` (Python's glob: no hidden names), each
    #: with ``{item_key}_wan_te.safetensors`` beside it.
    consumer_glob = ConsumerGlob((f"*_{ARCHITECTURE}.safetensors", f"*_{ARCHITECTURE}_te.safetensors"), hidden=False)

    def __init__(self, families: dict[str, Format] | None = None) -> None:
        #: family → the format object for musubi-tuner's architecture of it (`infra.formats.musubi_qi`); others: Wan's
        self.families = dict(families or {})

    def for_family(self, family: str | None) -> Format:
        return self.families.get(family or "", self)

    def writer(self, out: Path) -> MusubiWriter:
        return MusubiWriter(out, self)

    def keys_for(self, family: str | None) -> dict[str, str]:
        return musubi_hv15.KEYS if family == "hv15" else self.keys

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> MusubiWriter:
        if spec is not None:
            write_toml(Path(out), spec)
        writer = self.writer(out)  # a family's own format object's writer (`for_family`: musubi_qi's)
        writer.family = spec.family if spec is not None else None  # the layout the Wan writer renders (hv15's)
        return writer

    def trims_text_for(self, family: str) -> bool:
        return True  # musubi's T5 keeps the prompt's rows only (``u[:v]``)

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        """The text file's exact name; the latents file's without its frame range and source size (which the name
        takes from the clip: `MusubiWriter` keeps an identical file left at the full name)."""
        kinds = list(kinds)
        code = musubi_hv15.CODE if GLYPH_KIND in kinds else ARCHITECTURE  # only HunyuanVideo 1.5 has glyph rows
        text = ("text_embeddings", GLYPH_KIND)
        return {k: text_name(stem, code) if k in text else f"{flat_name(stem)}_{code}.safetensors" for k in kinds}

    def sample_file(self, stem: str, kinds: Iterable[str], rel: str) -> bool:
        """The text file's exact name, or a latents file of the stem at any frame range and source size."""
        if rel == text_name(stem):
            return True
        size = rf"\d{{4,}}x\d{{4,}}_{ARCHITECTURE}\.safetensors"
        return re.fullmatch(rf"{re.escape(flat_name(stem))}_(?:\d{{5,}}-\d{{3,}}_)?{size}", rel) is not None

    def read(self, path: Path | OutFile) -> dict[str, Any]:
        """The file's tensors under the keys musubi's loader gives them, its metadata and its marks (safetensors:
        no pickle)."""
        with opened(path) as fh:
            data = fh.read()
        (size,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        record: dict[str, Any] = {content_key(k): v for k, v in load(data).items()}
        marks = {"fingerprint": FINGERPRINT_KEY, "group": GROUP_KEY, "id": ID_KEY}
        return record | {"metadata": metadata} | {name: metadata.get(key) for name, key in marks.items()}

    def derived_buckets(self, config: Any, temporal: str) -> list[Bucket]:
        """musubi's buckets for ``--width``/``--height`` (its ``resolution``) and ``--frames`` (its one
        ``target_frames``); ConfigError for what its loader cannot read: other buckets, a policy other than ``head``."""
        enc = config.encoding
        if temporal != "head":
            raise ConfigError(
                f"--format musubi: musubi-tuner trains on a clip's first F frames (frame_extraction head), bucketed "
                f"from the source's size: use --temporal head, or --recipe musubi-wan (this run: {temporal})"
            )
        derived = musubi_buckets(enc.width, enc.height, enc.frames)
        if enc.buckets is not None and parse_buckets(enc.buckets) != derived:
            raise ConfigError(
                "--format musubi: musubi-tuner recomputes every bucket from the dataset's resolution: give it as "
                "--width/--height (and --frames), not --buckets"
            )
        return derived

    def check_out(self, out: Path, source: str) -> None:
        if outdir.is_store(out):  # its dataset config names the cache's folder for musubi-tuner to read from
            raise ConfigError(
                f"--format musubi: musubi-tuner reads its cache from a local folder (its dataset config names it), "
                f"not {out}: give --out a local folder"
            )
        check_cache_directory(Path(out), source)


__all__ = ["TOML_NAME", "MusubiFormat", "content_key", "flat_name", "latent_name", "text_name"]
