"""Batching by shape (``--video-batch N``), a stage of its own over the shard's read-ahead.

The read-ahead (`infra.preprocess.prefetch.Prefetcher`) only reads and prepares samples ahead and says what it has
prepared (`Prefetcher.prepared_ahead`); this stage picks from that the samples whose pixels have the current
sample's shape (`ready`), and keeps the latents (or the encode error) of those encoded with it until their turn
(`hold` / `release`: `infra.preprocess.vae_calls`). What it holds is dropped with the shard task (or `close`).
"""

from __future__ import annotations

from typing import Any

from infra.preprocess.prefetch import Prefetcher
from infra.preprocess.prepare import PreparedSample
from infra.sources import SampleRef


class ShapeBatches:
    """The batches of one shard task, made of what `ahead` has prepared."""

    def __init__(self, ahead: Prefetcher) -> None:
        self._ahead = ahead
        self._held: dict[str, Any] = {}  # ref key → latents (or the error) encoded at an earlier sample's turn

    def ready(self, count: int, shape: tuple[int, ...]) -> list[PreparedSample]:
        """Up to `count` of the samples prepared ahead (waiting for their decodes, in order) whose pixels have
        `shape`: what is batched with the current sample. One already held is left out."""
        found: list[PreparedSample] = []
        if count < 1:
            return found
        for prepared in self._ahead.prepared_ahead():
            if prepared.ref.key in self._held:  # encoded with an earlier sample: its decode had finished then
                continue
            if prepared.video is not None and tuple(prepared.video.pixels.shape) == shape:
                found.append(prepared)
                if len(found) == count:
                    break
        return found

    def hold(self, ref: SampleRef, result: Any) -> None:
        """Keep a sample's latents (or its encode error) until its turn (`release`)."""
        self._held[ref.key] = result

    def release(self, ref: SampleRef) -> Any | None:
        """The latents (or error) held for `ref`, forgotten here; None when none are held."""
        return self._held.pop(ref.key, None)

    def close(self) -> None:
        """Drop what is held (a stop: the samples it belongs to are not visited)."""
        self._held.clear()
