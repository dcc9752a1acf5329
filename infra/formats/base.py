"""The Writer / Reader contract and the format registry.

A writer is a context manager with `write(sample)`; every format has a reader, and every writer is
tested by a round trip through its reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from infra.cache.storage import Written


@dataclass
class EncodedSample:
    """One sample, encoded: what every writer receives."""

    id: str
    group: str
    prompt: str
    latents: torch.Tensor  # (C, F', H', W') bf16
    text_embeds: torch.Tensor  # (max_length, D) bf16
    seq_len: int
    source_shape: list[int]  # [T, H, W, C]
    fingerprint: str
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def latent_shape(self) -> list[int]:
        return list(self.latents.shape)


class Writer(Protocol):
    """Writes encoded samples under OUT. `replace` allows replacing an existing file (approved overwrite)."""

    def __enter__(self) -> Writer: ...

    def __exit__(self, *exc: object) -> None: ...

    def relpath(self, group: str, sample_id: str) -> str:
        """Where a sample goes, relative to OUT (deterministic: mirrors the source ids)."""
        ...

    def write(self, sample: EncodedSample, *, replace: bool = False) -> Written:
        """Write one sample atomically; FileExistsError if it exists and not `replace`."""
        ...


class Format(Protocol):
    """A cache format: its writer and its reader."""

    name: str

    def writer(self, out: Path) -> Writer: ...

    def relpath(self, group: str, sample_id: str) -> str: ...

    def read(self, path: Path) -> dict[str, Any]:
        """Load one stored sample safely (no pickled code)."""
        ...
