"""Decoded frames against the source, streamed: each chunk of decoded frames is scored and encoded into the
side-by-side mp4 as it arrives, and the three frames of the PNG strip are kept as they pass.

What is held at once: the source's pixels (the recipe's float32, needed to score), one decoded chunk, one
side-by-side frame and the strip's frames in uint8. At 33×832² the old path held a whole decoded copy (274 MB of
float32) and several whole side-by-side float copies (548 MB each) next to the source.
"""

from __future__ import annotations

import io
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from infra.audit import metrics
from infra.media.mp4 import Mp4Writer

FPS = 24
#: libx264 at near-lossless quality; "veryfast" is ~3× quicker than the default preset at 1664×832 (bigger file).
MP4_OPTIONS = {"crf": "15", "preset": "veryfast"}


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """(3, ..., W) in [-1, 1] → (..., W, 3) uint8, the inverse of the recipe's /127.5 - 1."""
    return ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(0, -1).contiguous()


def strip_picks(frames: int) -> list[int]:
    """The PNG strip's frames: first, middle and last."""
    return sorted({0, (frames - 1) // 2, frames - 1})


@dataclass(frozen=True)
class Comparison:
    """The metrics of a decoded video against its source and the files showing both."""

    score: metrics.VideoScore
    mp4: bytes  # source | decoded side by side (2W × H, padded to an even height), H.264 yuv420p
    strip: np.ndarray  # (2H, k·W, 3) uint8: the strip's source frames above their decoded frames

    def strip_png(self) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(self.strip).save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()


def compare(
    source: torch.Tensor, decoded: Iterable[torch.Tensor], device: metrics.Device = "cpu", fps: int = FPS
) -> Comparison:
    """Score `decoded` (chunks (3, f, H, W) in order, together the source's frames) against `source` (3, F, H, W),
    each chunk as it comes, writing the side-by-side mp4 and keeping the strip's frames. ValueError when the decoded
    frames do not have the source's shape (the decoder is closed either way)."""
    channels, frames, height, width = source.shape
    picks, kept = strip_picks(frames), {}
    side = np.zeros((height + height % 2, 2 * width, 3), dtype=np.uint8)  # one side-by-side frame, reused
    score, done, chunks = metrics.VideoScore(device), 0, iter(decoded)
    try:
        with Mp4Writer(fps, "libx264", "yuv420p", MP4_OPTIONS, side.shape[0], side.shape[1]) as writer:
            for chunk in _checked(chunks, source.shape):
                end = done + chunk.shape[1]
                score.add(source[:, done:end], chunk)
                pairs = zip(to_uint8(source[:, done:end]).numpy(), to_uint8(chunk).numpy(), strict=True)
                for index, (left, right) in enumerate(pairs, start=done):
                    side[:height, :width], side[:height, width:] = left, right
                    writer.write(side)
                    if index in picks:
                        kept[index] = side[:height].copy()
                done = end
            if done != frames:
                raise ValueError(f"decoded shape {(channels, done, height, width)} is not the source's {source.shape}")
            mp4 = writer.close()
    finally:  # a decoder stopped early (a bad shape) releases its model and cache now, not at garbage collection
        if isinstance(chunks, Generator):
            chunks.close()
    rows = [np.concatenate([kept[i][:, half] for i in picks], axis=1) for half in (slice(0, width), slice(width, None))]
    return Comparison(score, mp4, np.concatenate(rows, axis=0))


def _checked(chunks: Iterator[torch.Tensor], shape: torch.Size) -> Iterator[torch.Tensor]:
    """The chunks, each checked to continue a video of `shape` without running past its frames."""
    done = 0
    for chunk in chunks:
        if chunk.ndim != 4 or (chunk.shape[0], *chunk.shape[2:]) != (shape[0], *shape[2:]) or done >= shape[1]:
            raise ValueError(f"decoded frames of shape {tuple(chunk.shape)} do not fit the source's {tuple(shape)}")
        done += chunk.shape[1]
        if done > shape[1]:
            raise ValueError(f"decoded shape has more than the source's {shape[1]} frames ({tuple(shape)})")
        yield chunk
