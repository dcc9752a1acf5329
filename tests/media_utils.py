"""Test-side media helpers: cut and re-encode real clips with PyAV (no code shared with the pipeline)."""

from __future__ import annotations

import functools
import io
import json
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path

import av

from infra.demo.testmedia import real_clip


@functools.lru_cache(maxsize=64)
def cut_clip(
    video: bytes, frames: int, *, container: str = "mp4", width: int | None = None, crop: tuple[int, int] | None = None
) -> bytes:
    """The first `frames` frames of a real clip (their centre `crop` (height, width) where given), re-encoded with
    libx264 into `container`. Remembered per arguments:
    x264's output for the same frames has varied within one test process (7325 or 7425 bytes for one cut), and tests
    that rewrite a source expect the same cut to be the same bytes."""
    source = av.open(io.BytesIO(video))
    pictures = []
    for frame in source.decode(video=0):
        pictures.append(frame.to_ndarray(format="rgb24"))
        if len(pictures) == frames:
            break
    source.close()
    if crop is not None:
        top, left = (pictures[0].shape[0] - crop[0]) // 2, (pictures[0].shape[1] - crop[1]) // 2
        pictures = [p[top : top + crop[0], left : left + crop[1]].copy() for p in pictures]
    height_px, width_px = pictures[0].shape[:2]
    if width is not None:
        height_px, width_px = (height_px * width // width_px) // 2 * 2, width
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as dst:
        stream = dst.add_stream("libx264", rate=Fraction(25, 1))
        stream.width, stream.height, stream.pix_fmt = width_px, height_px, "yuv420p"
        # one encoder thread and explicit timestamps: the same bytes for the same frames on every call (threaded
        # x264 gave 7512 or 7891 bytes for one cut, so a test comparing two cuts' listings saw a change)
        stream.codec_context.thread_count = 1
        for index, picture in enumerate(pictures):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = index
            if width is not None:
                frame = frame.reformat(width=width_px, height=height_px)
            for packet in stream.encode(frame):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out.getvalue()


def _copy_video_packets(video: bytes, dst: av.container.OutputContainer) -> None:
    source = av.open(io.BytesIO(video))
    in_stream = source.streams.video[0]
    stream = dst.add_stream_from_template(in_stream)
    for packet in source.demux(in_stream):
        if packet.dts is None:
            continue
        packet.stream = stream
        dst.mux(packet)
    source.close()


def remux(video: bytes, container: str) -> bytes:
    """The same video packets in another container (no re-encode)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as dst:
        _copy_video_packets(video, dst)
    return out.getvalue()


def faststart(video: bytes) -> bytes:
    """The same video packets in an MP4 whose moov box comes before the media data (``movflags=faststart``).

    The muxer rewrites the file to move the index to the front, so it goes through a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "faststart.mp4"
        with av.open(str(path), mode="w", format="mp4", options={"movflags": "faststart"}) as dst:
            _copy_video_packets(video, dst)
        return path.read_bytes()


def annexb(video: bytes) -> bytes:
    """The H.264 video packets as a raw Annex B elementary stream (what ``ffmpeg -c copy x.h264`` writes)."""
    return remux(video, "h264")


def trainer_dataset(
    root: Path, clips: dict[str, str] | tuple[str, ...], rows: list[dict] | None = None, name: str = "dataset.json"
) -> Path:
    """An LTX-2 trainer dataset file at `root`/`name` over real clips copied to ``clips/<clip>.mp4``: `rows` as
    given, or one ``{"video", "caption"}`` row per clip of `clips` (clip → caption)."""
    (root / "clips").mkdir(parents=True, exist_ok=True)
    for clip in clips:
        shutil.copy(real_clip(clip), root / "clips" / f"{clip}.mp4")
    if rows is None:
        rows = [{"video": f"clips/{clip}.mp4", "caption": caption} for clip, caption in dict(clips).items()]
    path = root / name
    path.write_text(json.dumps(rows))
    return path
