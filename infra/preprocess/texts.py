"""Prompt embeddings, batched and de-duplicated: identical prompts are encoded once per shard task.

A task family repeats its prompts (VBVR: a generator's few templates over thousands of clips). Embeddings are kept
in the shard's state (`infra.preprocess.state.ShardState`: one encoder), keyed by the prompt and the text settings
(max_length, padding, stage), in a least-recently-used store bounded in bytes. A prompt that is not held is encoded
together with up to ``batch - 1`` upcoming prompts that are not held either (the shard's prefetcher knows them), in
one encoder call; every family's `encode_texts` gives each prompt exactly what `encode_text` gives it alone
(tests/test_text_batch.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from infra.models import LoadedFamily
from infra.models.base import TextEmbedding, TextSettings

logger = logging.getLogger(__name__)

#: Bytes of embeddings held per encoder by default (at 512 × 4096 bf16, 4 MiB a prompt: 128 prompts).
DEFAULT_CACHE_BYTES = 512 * 2**20


@dataclass
class TextStats:
    """What the text encoder did for one cache: calls (one per batch), prompts encoded, prompts served."""

    calls: int = 0
    encoded: int = 0
    served: int = 0


class TextCache:
    """One encoder's embeddings by (prompt, settings), least recently used first out past `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.stats = TextStats()
        self._held: OrderedDict[tuple[str, TextSettings], TextEmbedding] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def embedding(
        self,
        encoder: LoadedFamily,
        prompt: str,
        settings: TextSettings,
        *,
        upcoming: Sequence[str] = (),
        batch: int = 1,
    ) -> TextEmbedding:
        """The embedding of `prompt`, encoded now (with up to ``batch - 1`` of `upcoming` not held) or held."""
        with self._lock:
            held = self._get((prompt, settings))
            if held is not None:
                self.stats.served += 1
                return held
            todo = [prompt]
            for other in upcoming:
                if len(todo) >= batch:
                    break
                if other not in todo and (other, settings) not in self._held:
                    todo.append(other)
            embeddings = encoder.encode_texts(todo, settings)
            self.stats.calls += 1
            self.stats.encoded += len(todo)
            self.stats.served += 1
            for text, embedding in zip(todo, embeddings, strict=True):
                self._put((text, settings), embedding)
            return embeddings[0]

    def holds(self, prompt: str, settings: TextSettings) -> bool:
        """Whether the embedding of `prompt` under `settings` is held now."""
        with self._lock:
            return (prompt, settings) in self._held

    def lookup(self, prompt: str, settings: TextSettings) -> TextEmbedding | None:
        """The embedding of `prompt` if held (counted as served), else None; the encoder is not called."""
        with self._lock:
            held = self._get((prompt, settings))
            self.stats.served += held is not None
            return held

    def _get(self, key: tuple[str, TextSettings]) -> TextEmbedding | None:
        embedding = self._held.get(key)
        if embedding is not None:
            self._held.move_to_end(key)
        return embedding

    def _put(self, key: tuple[str, TextSettings], embedding: TextEmbedding) -> None:
        size = _nbytes(embedding)
        if size > self.max_bytes:
            return
        self._held[key] = embedding
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, dropped = self._held.popitem(last=False)
            self._bytes -= _nbytes(dropped)


def _nbytes(embedding: TextEmbedding) -> int:
    extras = sum(t.numel() * t.element_size() for t in embedding.extras.values())
    return embedding.embeds.numel() * embedding.embeds.element_size() + extras
