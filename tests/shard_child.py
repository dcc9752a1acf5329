"""Writes tiny encoded samples into shard parts: in the test process, or as a child the tests SIGKILL at a kill
point (``python -m tests.shard_child OUT FIRST LAST FORMAT``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from infra.formats import EncodedSample, get_format

PER_PART = 2


class Spec:
    """The rotation settings a CacheSpec of a shard format carries."""

    shard_samples, shard_bytes, parquet_dtype = PER_PART, 1 << 30, None


def made(i: int) -> EncodedSample:
    """Sample `i`: the same tensors every time."""
    g = torch.Generator().manual_seed(i)
    return EncodedSample(
        id=f"s{i}",
        group="g",
        stem=f"g/s{i}",
        prompt=f"sample {i}",
        latents=torch.randn(4, 2, 3, 5, generator=g).bfloat16(),
        text_embeds=torch.randn(8, 6, generator=g).bfloat16(),
        seq_len=5,
        source_shape=[5, 32, 32, 3],
        fingerprint="f" * 64,
        info={"fps": 24.0, "geometry": (5, 32, 32)},
    )


def write(out: Path, first: int, last: int, fmt: str, spec: object = Spec) -> None:
    """Samples first..last-1 of source shard ``s`` into OUT's parts (rotation as `spec` says)."""
    with get_format(fmt).open_writer(Path(out), spec, "s") as writer:
        for i in range(first, last):
            writer.write(made(i))


if __name__ == "__main__":
    write(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
