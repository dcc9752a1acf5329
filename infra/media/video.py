"""Video decoding with PyAV: exact temporal sampling, only the chosen frames kept in memory.

The frame count is never taken from the container header: packets are counted first (cheap,
no decoding), frames are picked during one decode pass, and if the decoder yields a different
number of frames than there were packets, the pass is repeated with the true count.

Limits (`MediaLimits`: ``--max-pixels``, ``--max-frames``) are checked when a file is opened, before any frame
is decoded: the stream's declared width × height and its header frame count, then its packet count (demuxing
stops one packet past the limit). FFmpeg is also given ``max_pixels``, so neither its own probing at open nor
a stream that grows mid-way can allocate a larger frame. A display-matrix rotation is recorded; PyAV and FFmpeg's
libraries decode the stored frames (only the ``ffmpeg`` program rotates), and so does this module unless asked for
the frames `upright` (``--rotate auto``, or a consumer whose reader turns them: `infra.formats.consumers`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
import torch

from infra.errors import InputError
from infra.media.resize import policy

logger = logging.getLogger(__name__)

#: Demuxers of still images (besides FFmpeg's "*_pipe" image demuxers): an image renamed .mp4 is not a clip.
IMAGE_FORMATS = frozenset({"image2", "gif", "ico", "msp", "apng", "alias_pix", "brender_pix", "sunrast"})


def is_image_format(name: str) -> bool:
    """True for FFmpeg demuxers that read still images."""
    return name.endswith("_pipe") or any(part in IMAGE_FORMATS for part in name.split(","))


class MediaError(InputError):
    """A sample's video cannot be used."""


#: Defaults of ``--max-pixels`` and ``--max-frames`` (BuildConfig's fields repeat them: config imports no media).
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_MAX_FRAMES = 100_000


@dataclass(frozen=True)
class MediaLimits:
    """What a clip may declare before it is decoded: pixels per frame and frames."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_frames: int = DEFAULT_MAX_FRAMES


DEFAULT_LIMITS = MediaLimits()


@dataclass(frozen=True)
class PixelTarget:
    """Pixels to make of the picked frames as they are decoded: height × width by a resize policy name
    (`RESIZE_POLICIES`). Each frame's numbers are `resize_pixels`' (per-frame arithmetic), bit for bit."""

    height: int
    width: int
    policy: str = "stretch"
    #: The run's compute dtype, where the policy's consumer scales its pixels in it (`infra.media.resize`).
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class SampledClip:
    """F frames picked from a clip, and what the clip was."""

    frames: np.ndarray  # (F, H, W, 3) uint8 RGB
    source_frames: int
    source_height: int
    source_width: int
    indices: tuple[int, ...]
    fps: float = 24.0  # the stream's average rate, else its base rate, else 24 (as the LTX-2 trainer reads it)
    #: The display matrix's counter-clockwise rotation in degrees (0: none): recorded, the frames are as stored.
    rotation: int = 0
    #: The picked frames as the recipe's pixels (1, 3, F, h, w), made as they were decoded (`PixelTarget`); then
    #: `frames` holds none: no source-resolution frame outlives its decoding.
    pixels: torch.Tensor | None = None

    @property
    def count(self) -> int:
        """Frames picked (rows of `frames`, or of `pixels`)."""
        return self.pixels.shape[2] if self.pixels is not None else self.frames.shape[0]

    @property
    def source_shape(self) -> list[int]:
        """[T, H, W, C] of the source clip."""
        return [self.source_frames, self.source_height, self.source_width, 3]


def linspace_indices(total: int, count: int) -> np.ndarray:
    """``np.linspace(0, total-1, count).round()``: spread evenly; repeats frames when total < count."""
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def sample_frames(
    data: bytes,
    num_frames: int,
    *,
    limits: MediaLimits = DEFAULT_LIMITS,
    target: PixelTarget | None = None,
    upright: bool = False,
) -> SampledClip:
    """Decode `data` (a whole video file) and return `num_frames` frames picked by linspace (with `target`, as
    pixels made while decoding; with `upright`, each frame turned by its display matrix first)."""
    if not data:
        raise MediaError("empty_video", "the video file has 0 bytes")
    packets, _ = _count_packets(data, limits)
    indices = linspace_indices(max(packets, 1), num_frames)
    clip, decoded = _decode_picking(data, indices, limits=limits, target=target, upright=upright)
    if decoded == 0:
        raise MediaError("no_frames", "the video stream decoded to 0 frames")
    if decoded != packets:
        logger.debug("container had %d packets but %d frames decoded: second pass", packets, decoded)
        again_indices = linspace_indices(decoded, num_frames)
        clip, again = _decode_picking(data, again_indices, limits=limits, target=target, upright=upright)
        if again != decoded:
            raise MediaError("video_decode_error", f"frame count unstable ({decoded} then {again})")
    return clip


def head_frames(data: bytes, count: int, *, limits: MediaLimits = DEFAULT_LIMITS, upright: bool = False) -> SampledClip:
    """The first `count` decoded frames of a video file (fewer when it is shorter): the LTX-2 trainer's sampling.
    `source_frames` is the clip's frame count (its packets); `fps` as the trainer records it; `upright`: each frame
    turned by its display matrix."""
    if not data:
        raise MediaError("empty_video", "the video file has 0 bytes")
    packets, _ = _count_packets(data, limits)
    clip, decoded = _decode_picking(data, np.arange(count), allow_short=True, limits=limits, upright=upright)
    if decoded == 0 or clip.frames.shape[0] == 0:
        raise MediaError("no_frames", "the video stream decoded to 0 frames")
    return dataclasses.replace(clip, source_frames=max(packets, decoded))


def probe_frames(data: bytes, *, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[int, float]:
    """(frames, fps) of a video file without decoding it: its non-empty packets and its rate (see `SampledClip`)."""
    if not data:
        raise MediaError("empty_video", "the video file has 0 bytes")
    count, fps = _count_packets(data, limits)
    return max(count, 1), fps


def pick_frames(
    data: bytes,
    choose: Callable[[int, float], tuple[int, ...]],
    *,
    limits: MediaLimits = DEFAULT_LIMITS,
    target: PixelTarget | None = None,
    upright: bool = False,
) -> SampledClip:
    """The frames ``choose(frames in the clip, fps)`` names, in its order (repeats allowed), decoding only up to
    the last of them (with `target`, as pixels made while decoding). If the clip turns out shorter than its packets
    said, the choice is made again with the frames it really has. `source_frames` is the clip's frame count as far
    as it is known."""
    packets, fps = probe_frames(data, limits=limits)
    indices = np.asarray(choose(packets, fps), dtype=np.int64)
    picking = {"allow_short": True, "limits": limits, "target": target, "upright": upright}
    clip, decoded = _decode_picking(data, np.unique(indices), **picking)
    if decoded == 0 or clip.count == 0:
        raise MediaError("no_frames", "the video stream decoded to 0 frames")
    if len(clip.indices) < len(np.unique(indices)):  # fewer frames than packets: choose again from what is there
        logger.debug("container had %d packets but decoding ended after %d frames: second pass", packets, decoded)
        packets = decoded
        indices = np.asarray(choose(decoded, fps), dtype=np.int64)
        clip, _ = _decode_picking(data, np.unique(indices), **picking)
        if len(clip.indices) < len(np.unique(indices)):
            raise MediaError("video_decode_error", f"frame count unstable (decoding ended after {decoded} frames)")
    row = {index: k for k, index in enumerate(clip.indices)}
    rows = [row[int(i)] for i in indices]
    indices_kept = tuple(int(i) for i in indices)
    if rows != list(range(len(clip.indices))):  # no copy when in order
        if clip.pixels is not None:
            clip = dataclasses.replace(clip, pixels=clip.pixels[:, :, rows].contiguous())
        else:
            clip = dataclasses.replace(clip, frames=clip.frames[rows])
    return dataclasses.replace(clip, source_frames=packets, indices=indices_kept)


def _fps(stream: av.video.stream.VideoStream) -> float:
    rate = stream.average_rate or stream.base_rate
    return float(rate) if rate else 24.0


def _open(
    data: bytes, limits: MediaLimits = DEFAULT_LIMITS
) -> tuple[av.container.InputContainer, av.video.stream.VideoStream]:
    """The container and its first video stream, refused (MediaError) when it is not a video or declares more
    than `limits` allow. Nothing is decoded here but what FFmpeg probes, and that within ``max_pixels``."""
    ffmpeg_limit = {"max_pixels": str(min(limits.max_pixels, 2**31 - 1))}
    try:
        container = av.open(io.BytesIO(data), mode="r", options=ffmpeg_limit)
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise MediaError("video_decode_error", f"cannot open container: {exc}") from exc
    if is_image_format(container.format.name):
        container.close()
        raise MediaError("not_a_video", f"the file is a still image ({container.format.name})")
    if not container.streams.video:
        kinds = ", ".join(sorted({s.type for s in container.streams})) or "none"
        container.close()
        raise MediaError("no_video_stream", f"the container has no video stream (streams: {kinds})")
    stream = container.streams.video[0]
    # One decoder thread: with frame threading FFmpeg may drop the error of a damaged last packet, so the
    # same file would be refused on a small machine and accepted on a big one. Samples run in parallel instead.
    stream.codec_context.thread_count = 1
    stream.codec_context.options = ffmpeg_limit
    try:
        _check_declared(stream, limits)
    except MediaError:
        container.close()
        raise
    return container, stream


def _check_declared(stream: av.video.stream.VideoStream, limits: MediaLimits) -> None:
    """Refuse a stream whose header declares a frame larger than ``max_pixels`` or more than ``max_frames``."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > limits.max_pixels:
        raise MediaError(
            "too_many_pixels",
            f"the video stream declares {width}x{height} = {width * height} pixels per frame; "
            f"--max-pixels is {limits.max_pixels}",
        )
    if stream.frames > limits.max_frames:
        raise MediaError(
            "too_many_frames",
            f"the container header declares {stream.frames} frames; --max-frames is {limits.max_frames}",
        )


def _count_packets(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[int, float]:
    """(the stream's non-empty packets, demuxed, not decoded; its fps), one open; MediaError past ``max_frames``
    (counting stops)."""
    container, stream = _open(data, limits)
    count = 0
    fps = _fps(stream)
    with container:
        try:
            for packet in container.demux(stream):
                if packet.size:
                    count += 1
                    if count > limits.max_frames:
                        raise MediaError(
                            "too_many_frames",
                            f"the video stream has more than {limits.max_frames} packets (frames); "
                            f"--max-frames is {limits.max_frames}",
                        )
        except av.FFmpegError as exc:
            logger.debug("demux stopped after %d packets: %s", count, exc)
    return count, fps


def _decode_picking(
    data: bytes,
    indices: np.ndarray,
    *,
    allow_short: bool = False,
    limits: MediaLimits = DEFAULT_LIMITS,
    target: PixelTarget | None = None,
    upright: bool = False,
) -> tuple[SampledClip, int]:
    """One decode pass keeping only frames whose index is in `indices` (with `allow_short`, stopping after the
    last of them and keeping what the clip has); returns (clip, frames decoded). Each kept frame is copied once,
    into its rows of one preallocated (F, H, W, 3) array: no second stacked copy of the clip. With `target`, each
    kept frame is made into its pixel rows as it is decoded instead (`_PickedPixels`)."""
    slots: dict[int, list[int]] = {}
    for row, index in enumerate(indices.tolist()):
        slots.setdefault(int(index), []).append(row)
    last = max(slots, default=-1)
    picked = _Picked(len(indices)) if target is None else _PickedPixels(len(indices), target)
    container, stream = _open(data, limits)
    fps = _fps(stream)
    n, rotation = 0, 0
    with container:
        try:
            for frame in container.decode(stream):
                if n in slots:
                    turn = _rotation(frame)
                    array = frame.to_ndarray(format="rgb24")
                    picked.put(n, slots[n], upright_frame(array, turn) if upright else array)
                    rotation = rotation or turn
                n += 1
                if allow_short and n > last:
                    break
        except av.FFmpegError as exc:
            raise MediaError("video_decode_error", f"decoding failed after {n} frames: {exc}") from exc
    if allow_short:
        kept = sorted(picked.kept)
        indices = np.array(kept, dtype=np.int64)
        frames = picked.rows([slots[i][0] for i in kept]) if kept else None
    else:
        frames = picked.array if picked.kept and len(picked.kept) == len(slots) else None
    empty = np.zeros((0, 0, 0, 3), dtype=np.uint8)
    if frames is None:
        return SampledClip(empty, n, 0, 0, tuple(indices.tolist()), fps), n
    picked.check_sizes()
    height, width = next(iter(picked.shapes))[:2]
    if target is not None:
        return SampledClip(empty, n, height, width, tuple(indices.tolist()), fps, rotation, pixels=frames), n
    return SampledClip(frames, n, height, width, tuple(indices.tolist()), fps, rotation), n


class _Picked:
    """The frames kept by one decode pass, written into a preallocated array as they come."""

    def __init__(self, rows: int) -> None:
        self.count, self.array, self.kept = rows, None, set()
        self.shapes: set[tuple[int, ...]] = set()

    def put(self, index: int, rows: list[int], frame: np.ndarray) -> None:
        self.kept.add(index)
        self.shapes.add(frame.shape)
        if self.array is None:
            self.array = np.empty((self.count, *frame.shape), dtype=np.uint8)
        if frame.shape == self.array.shape[1:]:
            self.array[rows] = frame

    def check_sizes(self) -> None:
        if len(self.shapes) > 1:
            sizes = ", ".join(f"{w}x{h}" for h, w, _ in sorted(self.shapes))
            raise MediaError("variable_resolution", f"the picked frames differ in size ({sizes})")

    def rows(self, rows: list[int]) -> np.ndarray:
        """The array cut to `rows` (all of them: the array itself, no copy)."""
        return self.array if rows == list(range(self.count)) else self.array[rows]


class _PickedPixels(_Picked):
    """The frames kept by one decode pass, each made into its pixel rows as it comes: what exists at source
    resolution is the decoder's frame and one float copy of it, whatever the clip's length or the count picked.
    ``array`` is the pixels (1, 3, F, h, w); `rows` cuts them on the frame axis."""

    def __init__(self, rows: int, target: PixelTarget) -> None:
        super().__init__(rows)
        self.target, self.policy = target, policy(target.policy)
        self.scratch: torch.Tensor | None = None
        self.started = False

    def put(self, index: int, rows: list[int], frame: np.ndarray) -> None:
        self.kept.add(index)
        self.shapes.add(frame.shape)
        if not self.started:
            self.started, self.first_shape = True, frame.shape
            self.scratch = self.policy.scratch((1, *frame.shape))
            self.array = torch.empty((1, 3, self.count, self.target.height, self.target.width), dtype=torch.float32)
        if frame.shape != self.first_shape:
            return  # `check_sizes` refuses the clip
        target = self.target
        part = self.policy.convert(frame[None], target.height, target.width, self.scratch, target.dtype)[0]  # 1 frame
        for row in rows:
            self.array[0, :, row] = part

    def rows(self, rows: list[int]) -> torch.Tensor:
        return self.array if rows == list(range(self.count)) else self.array[:, :, rows].contiguous()


def upright_frame(frame: np.ndarray, rotation: int) -> np.ndarray:
    """An (H, W, 3) frame turned counter-clockwise by its display matrix's `rotation` (degrees; a multiple of 90, as
    the ``ffmpeg`` program's autorotate turns it: ``transpose=cclock`` for 90, ``hflip,vflip`` for 180,
    ``transpose=clock`` for 270), contiguous. A mirrored matrix's flip is not applied (PyAV exposes the angle only)."""
    turns = round(rotation / 90) % 4
    return np.ascontiguousarray(np.rot90(frame, k=turns)) if turns else frame


def _rotation(frame: av.VideoFrame) -> int:
    """The frame's display-matrix rotation (degrees counter-clockwise, rounded; 0 without one)."""
    try:
        return round(frame.rotation or 0)
    except (ValueError, TypeError, AttributeError):  # a malformed matrix is no rotation we can record
        return 0
