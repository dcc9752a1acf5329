"""Source readers. Importing this package registers every built-in kind (``vbvr:``, ``meta:``, ``wds:``,
``folder:``)."""

from infra.sources import folder, meta, vbvr, wds
from infra.sources.base import (
    Problem,
    SampleProblem,
    SampleRef,
    Shard,
    ShardReadError,
    Source,
    SourceError,
    is_safe_name,
    open_source,
)

__all__ = [
    "Problem",
    "SampleProblem",
    "SampleRef",
    "Shard",
    "ShardReadError",
    "Source",
    "SourceError",
    "folder",
    "is_safe_name",
    "meta",
    "open_source",
    "vbvr",
    "wds",
]
