"""The Writer / Reader contract and the format registry.

A writer is a context manager with `write(sample)`; every format has a reader, and every writer is
tested by a round trip through its reader.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.cache.ledger import LedgerRow
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

    def outputs(self) -> dict[str, torch.Tensor]:
        """Each output kind's tensor: latents, text_embeddings, and any other kind the family adds in extras."""
        tensors = {k: v for k, v in self.extras.items() if isinstance(v, torch.Tensor)}
        return {"latents": self.latents, "text_embeddings": self.text_embeds, **tensors}


@dataclass(frozen=True)
class OutputFile:
    """Where one output kind of a done sample lives (OUT-relative) and its size per the ledger."""

    path: str | None
    bytes: int | None


class Writer(ABC):
    """Writes encoded samples under OUT, as a context manager (`close` on exit finishes what is open).
    `replace` allows replacing an existing file (an approved overwrite)."""

    def __init__(self, out: Path, fmt: Format) -> None:
        self.out = Path(out)
        self.format = fmt

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - a hook: per-sample formats have nothing to finish
        """Finish what is open (a shard file, say)."""

    def relpath(self, group: str, sample_id: str) -> str:
        """Where a sample goes, relative to OUT (deterministic: mirrors the source ids)."""
        return self.format.relpath(group, sample_id)

    @abstractmethod
    def write(self, sample: EncodedSample, *, replace: bool = False) -> Written:
        """Write one sample atomically; FileExistsError if it exists and not `replace`."""


class Format(ABC):
    """A cache format: its writer, its path rule and its reader; every writer round-trips through its reader."""

    name: ClassVar[str]
    #: Output kind → the key that holds it in a record `read` returns (x0, text_embeds, ...).
    keys: ClassVar[dict[str, str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [a for a in ("name", "keys") if not inspect.isabstract(cls) and not hasattr(cls, a)]
        if missing:
            raise TypeError(f"format {cls.__name__} does not declare {', '.join(missing)}")

    def files(self, row: LedgerRow, kinds: Iterable[str]) -> dict[str, OutputFile]:
        """Where each output kind of a done row is stored; by default all kinds share the row's one file."""
        return {kind: OutputFile(row.path, row.bytes) for kind in kinds}

    @abstractmethod
    def writer(self, out: Path) -> Writer:
        """A writer of samples under OUT."""

    @abstractmethod
    def relpath(self, group: str, sample_id: str) -> str:
        """OUT-relative path of one sample's (first) file."""

    @abstractmethod
    def read(self, path: Path) -> dict[str, Any]:
        """Load one stored sample safely (no pickled code: ``weights_only=True`` or safetensors)."""
