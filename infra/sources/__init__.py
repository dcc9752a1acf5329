"""Source readers. Importing this package registers every built-in kind (``vbvr:``, ...)."""

from infra.sources import meta, vbvr
from infra.sources.base import SampleRef, Shard, ShardReadError, Source, SourceError, is_safe_name, open_source

__all__ = [
    "SampleRef",
    "Shard",
    "ShardReadError",
    "Source",
    "SourceError",
    "is_safe_name",
    "meta",
    "open_source",
    "vbvr",
]
