"""Writing frames as an MP4 in memory (decode-and-verify's side-by-side clips, the overfit export's references)."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np


def mp4_bytes(frames: np.ndarray, fps: float, codec: str, pix_fmt: str, options: dict[str, str]) -> bytes:
    """(F, H, W, 3) uint8 RGB frames encoded with `codec` as `pix_fmt`, at `fps`, into MP4 bytes."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001), options=options)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], pix_fmt
        for picture in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()
