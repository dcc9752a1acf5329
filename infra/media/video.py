"""Video decoding with PyAV: exact temporal sampling, only the chosen frames kept in memory.

The frame count is never taken from the container header: packets are counted first (cheap,
no decoding), frames are picked during one decode pass, and if the decoder yields a different
number of frames than there were packets, the pass is repeated with the true count.

Limits (`MediaLimits`: ``--max-pixels``, ``--max-frames``) are checked when a file is opened, before any frame
is decoded: the stream's declared width × height and its header frame count, then its packet count (demuxing
stops one packet past the limit). FFmpeg is also given ``max_pixels``, so neither its own probing at open nor
a stream that grows mid-way can allocate a larger frame. A display-matrix rotation is not applied (PyAV and
FFmpeg's libraries decode the stored frames; only the ``ffmpeg`` program rotates): it is recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
import torch
import torch.nn.functional as F

from infra.errors import InputError

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


#: Resize policies: the name a user gives → the value the CacheSpec records (stretch keeps latentforge 0.1's).
RESIZE_POLICIES: dict[str, str] = {
    "stretch": "bilinear-align_corners_false",
    "cover-crop": "bicubic-antialias-cover-center-crop",
    "cover-crop-aa": "bilinear-antialias-cover-center-crop",
    # images only (`infra.media.image`): torchvision's Resize(BICUBIC) + CenterCrop on a PIL image
    "torchvision": "torchvision-pil-bicubic-short-side-center-crop",
}
#: Policies for still images only (Pillow, `infra.media.image.IMAGE_POLICIES`): no video family takes them.
IMAGE_ONLY_POLICIES = frozenset({"torchvision"})


def resize_policy_of(spec_value: str) -> str:
    """The policy name of a CacheSpec's ``resize`` value."""
    return next((name for name, value in RESIZE_POLICIES.items() if value == spec_value), spec_value)


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
    data: bytes, num_frames: int, *, limits: MediaLimits = DEFAULT_LIMITS, target: PixelTarget | None = None
) -> SampledClip:
    """Decode `data` (a whole video file) and return `num_frames` frames picked by linspace (with `target`, as
    pixels made while decoding)."""
    if not data:
        raise MediaError("empty_video", "the video file has 0 bytes")
    packets, _ = _count_packets(data, limits)
    indices = linspace_indices(max(packets, 1), num_frames)
    clip, decoded = _decode_picking(data, indices, limits=limits, target=target)
    if decoded == 0:
        raise MediaError("no_frames", "the video stream decoded to 0 frames")
    if decoded != packets:
        logger.debug("container had %d packets but %d frames decoded: second pass", packets, decoded)
        clip, again = _decode_picking(data, linspace_indices(decoded, num_frames), limits=limits, target=target)
        if again != decoded:
            raise MediaError("video_decode_error", f"frame count unstable ({decoded} then {again})")
    return clip


def head_frames(data: bytes, count: int, *, limits: MediaLimits = DEFAULT_LIMITS) -> SampledClip:
    """The first `count` decoded frames of a video file (fewer when it is shorter): the LTX-2 trainer's sampling.
    `source_frames` is the clip's frame count (its packets); `fps` as the trainer records it."""
    if not data:
        raise MediaError("empty_video", "the video file has 0 bytes")
    packets, _ = _count_packets(data, limits)
    clip, decoded = _decode_picking(data, np.arange(count), allow_short=True, limits=limits)
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
) -> SampledClip:
    """The frames ``choose(frames in the clip, fps)`` names, in its order (repeats allowed), decoding only up to
    the last of them (with `target`, as pixels made while decoding). If the clip turns out shorter than its packets
    said, the choice is made again with the frames it really has. `source_frames` is the clip's frame count as far
    as it is known."""
    packets, fps = probe_frames(data, limits=limits)
    indices = np.asarray(choose(packets, fps), dtype=np.int64)
    clip, decoded = _decode_picking(data, np.unique(indices), allow_short=True, limits=limits, target=target)
    if decoded == 0 or clip.count == 0:
        raise MediaError("no_frames", "the video stream decoded to 0 frames")
    if len(clip.indices) < len(np.unique(indices)):  # fewer frames than packets: choose again from what is there
        logger.debug("container had %d packets but decoding ended after %d frames: second pass", packets, decoded)
        packets = decoded
        indices = np.asarray(choose(decoded, fps), dtype=np.int64)
        clip, _ = _decode_picking(data, np.unique(indices), allow_short=True, limits=limits, target=target)
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
                    picked.put(n, slots[n], frame.to_ndarray(format="rgb24"))
                    rotation = rotation or _rotation(frame)
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
        self.target, self.convert = target, _CONVERTERS[target.policy]
        self.scratch: torch.Tensor | None = None

    def put(self, index: int, rows: list[int], frame: np.ndarray) -> None:
        self.kept.add(index)
        self.shapes.add(frame.shape)
        if self.scratch is None:
            self.scratch = torch.empty((1, *frame.shape), dtype=torch.float32)
            self.array = torch.empty((1, 3, self.count, self.target.height, self.target.width), dtype=torch.float32)
        if frame.shape != self.scratch.shape[1:]:
            return  # `check_sizes` refuses the clip
        self.scratch.copy_(torch.from_numpy(frame)[None])  # as `_chunked` does, one frame a chunk
        part = self.convert(self.scratch, self.target.height, self.target.width)[0]
        for row in rows:
            self.array[0, :, row] = part

    def rows(self, rows: list[int]) -> torch.Tensor:
        return self.array if rows == list(range(self.count)) else self.array[:, :, rows].contiguous()


def _rotation(frame: av.VideoFrame) -> int:
    """The frame's display-matrix rotation (degrees counter-clockwise, rounded; 0 without one)."""
    try:
        return round(frame.rotation or 0)
    except (ValueError, TypeError, AttributeError):  # a malformed matrix is no rotation we can record
        return 0


#: Frames turned into float pixels at once: the float32 copy of a chunk (4 frames of 1080p: ~100 MB) is all that
#: exists at source resolution beside the uint8 frames, so the peak does not grow with the clip's length. Each
#: frame's numbers are computed exactly as in one whole-tensor call (per-frame arithmetic, same memory layout).
PIXEL_CHUNK = 4


def frames_to_pixels(frames: np.ndarray, height: int, width: int, *, chunk: int = PIXEL_CHUNK) -> torch.Tensor:
    """(F,H,W,3) uint8 → (1,3,F,height,width) float32 in [-1, 1]: /127.5-1, bilinear, align_corners=False;
    `chunk` frames at a time (bit-identical to one call over all frames)."""
    return _chunked(frames, height, width, chunk, _stretch_chunk)


def _stretch_chunk(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    x.div_(127.5).sub_(1.0)  # in place: the same arithmetic as x / 127.5 - 1.0
    x = x.permute(0, 3, 1, 2)  # (T, C, H, W), channels-last in memory as the whole-tensor path has it
    return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)


def _chunked(
    frames: np.ndarray, height: int, width: int, chunk: int, convert: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """(1,3,F,height,width) float32: `convert` (a chunk's frames as float32 (t,H,W,3), changed in place as it
    likes → (t,3,height,width)) applied `chunk` frames at a time, each result copied into one preallocated output.

    The chunks' float frames share one buffer: a new source-resolution float tensor per chunk (~100 MB at 1080p)
    is fresh memory the kernel must fault in again each time, where copying into the same buffer is not. The
    values are those of ``.float()`` (uint8 → float32 is exact), in the same contiguous layout."""
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    out = torch.empty((1, 3, frames.shape[0], height, width), dtype=torch.float32)
    scratch = torch.empty((min(chunk, frames.shape[0]), *frames.shape[1:]), dtype=torch.float32)
    for first in range(0, frames.shape[0], chunk):
        source = torch.from_numpy(frames[first : first + chunk])
        x = scratch[: source.shape[0]]
        x.copy_(source)
        part = convert(x, height, width)
        out[0, :, first : first + part.shape[0]] = part.permute(1, 0, 2, 3)
    return out


def cover_crop_pixels(
    frames: np.ndarray, height: int, width: int, mode: str = "bicubic", *, chunk: int = PIXEL_CHUNK
) -> torch.Tensor:
    """(F,H,W,3) uint8 → (1,3,F,height,width) float32 in [-1, 1], as the LTX-2 trainer prepares a clip: /255,
    `mode` resize (antialiased, as torchvision's tensor resize by default) so the frame covers height×width with
    its aspect kept (the other side truncated to an int), centre crop, clamp to [0, 1], then (x - 0.5) / 0.5.
    ``mode="bilinear"`` is FastVideo's (bilinear with antialias, cover, centre crop). `chunk` frames at a time."""
    return _chunked(frames, height, width, chunk, functools.partial(_cover_chunk, mode=mode))


def _cover_chunk(x: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    x.div_(255.0)
    x = x.permute(0, 3, 1, 2)  # (F, C, H, W)
    src_h, src_w = x.shape[-2:]
    if src_w / src_h > width / height:
        size = (height, int(src_w * height / src_h))
    else:
        size = (int(src_h * width / src_w), width)
    x = F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=True)
    top, left = (x.shape[-2] - height) // 2, (x.shape[-1] - width) // 2
    x = x[:, :, top : top + height, left : left + width].clamp_(0, 1)
    return (x - 0.5) / 0.5


#: A resize policy's conversion of a chunk of float frames (t, H, W, 3), changed in place → (t, 3, h, w).
_CONVERTERS: dict[str, Callable[[torch.Tensor, int, int], torch.Tensor]] = {
    "stretch": lambda x, h, w: _stretch_chunk(x, h, w),  # looked up when called (tests wrap it)
    "cover-crop": lambda x, h, w: _cover_chunk(x, h, w, "bicubic"),
    "cover-crop-aa": lambda x, h, w: _cover_chunk(x, h, w, "bilinear"),
}


def resize_pixels(
    frames: np.ndarray, height: int, width: int, policy: str, *, chunk: int = PIXEL_CHUNK
) -> torch.Tensor:
    """Frames to pixels by a resize policy name (`RESIZE_POLICIES`), `chunk` frames at a time."""
    if policy not in _CONVERTERS:
        raise ValueError(f"unknown resize policy {policy!r}")
    return _chunked(frames, height, width, chunk, _CONVERTERS[policy])
