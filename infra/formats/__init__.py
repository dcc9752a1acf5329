"""Cache formats: name → format (writer + reader)."""

from __future__ import annotations

from infra.formats.base import EncodedSample, Format, Writer
from infra.formats.pt import PtFormat
from infra.registry import Registry

FORMATS: Registry[Format] = Registry("format")
FORMATS.add("pt", PtFormat())

__all__ = ["FORMATS", "EncodedSample", "Format", "Writer", "get_format"]


def get_format(name: str) -> Format:
    """The format registered under `name`."""
    return FORMATS.get(name)
