"""Writing frames as an MP4 in memory (decode-and-verify's side-by-side clips, the overfit export's references)."""

from __future__ import annotations

import io
from fractions import Fraction
from types import TracebackType

import av
import numpy as np


class Mp4Writer:
    """An MP4 in memory, written a frame at a time: `write` (H, W, 3) uint8 RGB frames, then `close` for the bytes.
    A context manager; leaving it on an error discards what was written."""

    def __init__(self, fps: float, codec: str, pix_fmt: str, options: dict[str, str], height: int, width: int) -> None:
        self._buffer = io.BytesIO()
        self._container = av.open(self._buffer, mode="w", format="mp4")
        self._stream = self._container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001), options=options)
        self._stream.height, self._stream.width, self._stream.pix_fmt = height, width, pix_fmt

    def write(self, picture: np.ndarray) -> None:
        self._container.mux(self._stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))

    def close(self) -> bytes:
        """Flush the encoder and finish the file; its bytes."""
        self._container.mux(self._stream.encode())
        self._container.close()
        return self._buffer.getvalue()

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self._container.close()


def mp4_bytes(frames: np.ndarray, fps: float, codec: str, pix_fmt: str, options: dict[str, str]) -> bytes:
    """(F, H, W, 3) uint8 RGB frames encoded with `codec` as `pix_fmt`, at `fps`, into MP4 bytes."""
    with Mp4Writer(fps, codec, pix_fmt, options, frames.shape[1], frames.shape[2]) as writer:
        for picture in frames:
            writer.write(picture)
        return writer.close()
