"""The Source contract: shards of samples, each sample lazily readable.

A Source lists its shards (the unit of work, retry and resume) and yields the samples of one shard
as `SampleRef`s. Media bytes are read only when asked, so a resumed run skips done samples without
reading or decoding their video.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

#: Groups, ids and shard ids become path components: only these characters, never "." or "..".
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}$")


def is_safe_name(name: str) -> bool:
    """True when `name` can be used as one path component under OUT."""
    return bool(SAFE_NAME.fullmatch(name)) and ".." not in name


@dataclass(frozen=True)
class Shard:
    """One unit of work: usually one file of the source."""

    id: str
    path: str
    size: int = 0


@dataclass
class SampleRef:
    """One source sample. `read_media` / `read_prompt` return None when the member is missing and raise
    InputError when it is there but cannot be read. Readable while its shard is being iterated."""

    id: str
    group: str
    key: str
    read_media: Callable[[], bytes | None]
    read_prompt: Callable[[], bytes | None]
    extra: dict[str, str] = field(default_factory=dict)


class Source(Protocol):
    """What every source kind implements."""

    kind: str

    def shards(self) -> list[Shard]:
        """All shards, in a stable order."""
        ...

    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        """The samples of one shard, in a stable order."""
        ...


class ShardReadError(RuntimeError):
    """A shard could not be read to its end; the samples listed before the damage were yielded first."""


class SourceError(ValueError):
    """A source that cannot be listed at all (bad path, no shards)."""


SourceFactory = Callable[[str], Source]
_REGISTRY: dict[str, SourceFactory] = {}


def register_source(kind: str) -> Callable[[SourceFactory], SourceFactory]:
    """Class decorator: make a source kind available as ``KIND:PATH``."""

    def wrap(factory: SourceFactory) -> SourceFactory:
        _REGISTRY[kind] = factory
        return factory

    return wrap


def open_source(spec: str) -> Source:
    """Build a Source from ``KIND:PATH``."""
    kind, _, path = spec.partition(":")
    if kind not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise SourceError(f"unknown source kind {kind!r} in {spec!r}; known kinds: {known}")
    return _REGISTRY[kind](path)
