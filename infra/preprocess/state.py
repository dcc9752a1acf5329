"""What one shard task's samples share on their trip, passed down instead of parked in module globals.

The run's own state (`infra.ops.progress.RunState`: its counts and stop check) is made by the flow and handed to
every shard task; each shard task makes a `ShardState` from it: the read-ahead, the prompt embeddings and the VAE's
work counts, handed to each stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from infra.ops.progress import RunState
from infra.preprocess.prefetch import Prefetcher
from infra.preprocess.shape_batches import ShapeBatches
from infra.preprocess.texts import TextCache
from infra.preprocess.vae_calls import VideoStats

__all__ = ["RunState", "ShardState"]


@dataclass
class ShardState:
    """What one shard task's samples share: the run's state, the prompt embeddings of its encoder (bounded by
    ``--text-cache-mb``), the VAE's work counts, the shard's read-ahead (None: one sample at a time) and its video
    batches."""

    run: RunState
    texts: TextCache
    vae: VideoStats = field(default_factory=VideoStats)
    ahead: Prefetcher | None = None
    #: The video batches made of what `ahead` prepared (`infra.preprocess.shape_batches`); None without a read-ahead.
    batches: ShapeBatches | None = None
    #: Notes a sample's trip starting before its bytes are read now, nothing else in flight (the journal's mark:
    #: `infra.preprocess.inflight`); None: not noted (the sanity, a dry run).
    mark: Callable[[str], None] | None = None
