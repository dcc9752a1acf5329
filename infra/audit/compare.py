"""Decoded frames against the source, streamed: scored and drawn into one uint8 canvas as each chunk arrives.

The canvas ``(F, H', 2W, 3)`` holds the source on the left and the decoded frames on the right (H padded to even
for yuv420p): it is the side-by-side mp4's frames, and the PNG strip is cut from it. At 33×832² that is 137 MB of
uint8, where a whole decoded copy alone is 274 MB of float32 (and the old side-by-side made several of 548 MB).
"""

from __future__ import annotations

import io
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from infra.audit import metrics
from infra.media.mp4 import mp4_bytes

FPS = 24
PIXEL_CHUNK = 4  # source frames turned into uint8 at a time
#: libx264 at near-lossless quality; "veryfast" is ~3× quicker than the default preset at 1664×832 (bigger file).
MP4_OPTIONS = {"crf": "15", "preset": "veryfast"}


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """(3, ..., W) in [-1, 1] → (..., W, 3) uint8, the inverse of the recipe's /127.5 - 1."""
    return ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(0, -1).contiguous()


@dataclass
class Comparison:
    """The metrics of a decoded video against its source, and the canvas showing both."""

    score: metrics.VideoScore
    canvas: np.ndarray  # (F, H + H % 2, 2W, 3) uint8: source | decoded
    height: int
    width: int

    def mp4(self, fps: int = FPS) -> bytes:
        """Source and decoded side by side (2W × H, padded to an even height) as H.264 yuv420p in MP4."""
        return mp4_bytes(self.canvas, fps, "libx264", "yuv420p", MP4_OPTIONS)

    def strip_png(self) -> bytes:
        """First, middle and last frame: the source above the decoded frames, as one PNG (k·W × 2H)."""
        count, h, w = len(self.canvas), self.height, self.width
        picks = sorted({0, (count - 1) // 2, count - 1})
        top = np.concatenate([self.canvas[i, :h, :w] for i in picks], axis=1)
        bottom = np.concatenate([self.canvas[i, :h, w:] for i in picks], axis=1)
        buffer = io.BytesIO()
        Image.fromarray(np.concatenate([top, bottom], axis=0)).save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()


def compare(source: torch.Tensor, decoded: Iterable[torch.Tensor], device: metrics.Device = "cpu") -> Comparison:
    """Score `decoded` (chunks (3, f, H, W) in order, together the source's frames) against `source` (3, F, H, W),
    each chunk as it comes, and draw both into the canvas. ValueError when the decoded frames do not have the
    source's shape (the chunks are closed either way)."""
    channels, frames, height, width = source.shape
    canvas = np.zeros((frames, height + height % 2, 2 * width, 3), dtype=np.uint8)
    for start in range(0, frames, PIXEL_CHUNK):
        canvas[start : start + PIXEL_CHUNK, :height, :width] = to_uint8(source[:, start : start + PIXEL_CHUNK])
    score, done, chunks = metrics.VideoScore(device), 0, iter(decoded)
    try:
        for chunk in _checked(chunks, source.shape):
            end = done + chunk.shape[1]
            score.add(source[:, done:end], chunk)
            canvas[done:end, :height, width:] = to_uint8(chunk)
            done = end
    finally:  # a decoder stopped early (a bad shape) releases its model and cache now, not at garbage collection
        if isinstance(chunks, Generator):
            chunks.close()
    if done != frames:
        raise ValueError(f"decoded shape {(channels, done, height, width)} is not the source's {tuple(source.shape)}")
    return Comparison(score, canvas, height, width)


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
