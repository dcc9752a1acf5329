"""Cache formats: name → format (writer + reader)."""

from __future__ import annotations

from infra.formats.base import AUDIO_KIND, EncodedSample, Format, PerSampleWriter, Writer, WrittenSample
from infra.formats.diffsynth import DiffSynthFormat
from infra.formats.diffsynth_qwen import DiffSynthQwenFormat
from infra.formats.ltx import LtxFormat
from infra.formats.musubi import MusubiFormat
from infra.formats.musubi_qi import MusubiQiFormat
from infra.formats.parquet import ParquetFormat
from infra.formats.pt import PtFormat
from infra.formats.shards import ShardFormat
from infra.formats.webdataset import WebDatasetFormat
from infra.registry import Registry

FORMATS: Registry[Format] = Registry("format")
FORMATS.add("pt", PtFormat())
FORMATS.add("ltx", LtxFormat())
FORMATS.add("webdataset", WebDatasetFormat())
FORMATS.add("parquet", ParquetFormat())
FORMATS.add("musubi", MusubiFormat({"qwen-image": MusubiQiFormat()}))
FORMATS.add("diffsynth", DiffSynthFormat({"qwen-image": DiffSynthQwenFormat()}))

__all__ = [
    "AUDIO_KIND",
    "FORMATS",
    "EncodedSample",
    "Format",
    "PerSampleWriter",
    "ShardFormat",
    "Writer",
    "WrittenSample",
    "get_format",
]


def get_format(name: str, family: str | None = None) -> Format:
    """The format registered under `name`, as it lays out `family`'s samples (`Format.for_family`: a consumer that
    names and keys each family its own way, musubi-tuner's ``qi`` files say)."""
    return FORMATS.get(name).for_family(family)
