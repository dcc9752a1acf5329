"""Cache formats: name → format (writer + reader)."""

from __future__ import annotations

from infra.errors import ConfigError
from infra.formats.base import EncodedSample, Format, Writer
from infra.formats.pt import PtFormat

FORMATS: dict[str, Format] = {"pt": PtFormat()}

__all__ = ["FORMATS", "EncodedSample", "Format", "Writer", "get_format"]


def get_format(name: str) -> Format:
    """The format registered under `name`."""
    try:
        return FORMATS[name]
    except KeyError as exc:
        raise ConfigError(f"unknown format {name!r}; known formats: {', '.join(sorted(FORMATS))}") from exc
