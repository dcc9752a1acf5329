"""infra.media (video, prompts) on real clips, each result checked against a plain PyAV reference written here.

The reference shares no code with the pipeline: it decodes every frame with PyAV (no threading),
converts each one with ``to_ndarray(format="rgb24")`` and picks ``np.linspace(0, T-1, F).round()``
where T is the number of frames that really decoded.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from infra.errors import InputError
from infra.media.prompts import decode_prompt
from infra.media.resize import frames_to_pixels
from infra.media.video import MediaError, SampledClip, sample_frames
from tests.media_utils import annexb, cut_clip, faststart, remux

LONG_F, SHORT_F = 33, 17  # two frame counts of the real recipe (F ≡ 1 mod 4)
FEW_FRAMES = 5  # a cut much shorter than either F
# (frames, height, width) of the real clips, as the files say and as they decode.
CLIP_GEOMETRY = {
    "bigbuckbunny": (132, 720, 1280),
    "bikes": (250, 272, 640),
    "carphone": (120, 144, 176),
    "sample_1080p": (23, 1080, 1920),
}
CARPHONE_FRAMES = CLIP_GEOMETRY["carphone"][0]
CARPHONE_TICKS_PER_FRAME = 1001  # carphone: 30000/1001 fps in a 1/30000 media time base
CARPHONE_EDIT_START = 2002  # carphone's own edit list starts the presentation at media time 2002 (B-frame delay)
HIDDEN_BY_EDIT = 5  # frames an edited edit list hides at the start
DURATION_SCALE = 10  # header durations are divided by this
PIXEL_HEIGHT, PIXEL_WIDTH = 48, 80  # H ≠ W so a swapped axis shows
NOISE_BYTES = 4096
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the plain reference


def decode_all(video: bytes) -> list[np.ndarray]:
    """Every frame PyAV decodes, as RGB24 arrays."""
    container = av.open(io.BytesIO(video))
    frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    container.close()
    return frames


def pick(frames: list[np.ndarray], count: int) -> tuple[tuple[int, ...], np.ndarray]:
    """np.linspace indices over the decoded frames, and those frames stacked."""
    indices = np.linspace(0, len(frames) - 1, count).round().astype(int)
    return tuple(int(i) for i in indices), np.stack([frames[i] for i in indices])


def reference(video: bytes, counts: tuple[int, ...]) -> tuple[int, dict[int, tuple[tuple[int, ...], np.ndarray]]]:
    """(T, {F: (indices, frames)}) from one full decode."""
    frames = decode_all(video)
    return len(frames), {count: pick(frames, count) for count in counts}


def assert_matches(clip: SampledClip, total: int, indices: tuple[int, ...], expected: np.ndarray) -> None:
    assert clip.frames.dtype == np.uint8
    assert clip.frames.shape == expected.shape
    assert clip.source_frames == total
    assert clip.indices == indices
    assert clip.source_shape == [total, expected.shape[1], expected.shape[2], 3]
    assert (clip.source_height, clip.source_width) == expected.shape[1:3]
    assert np.array_equal(clip.frames, expected)


def mp4_box(data: bytes | bytearray, kind: bytes) -> int:
    """Offset of the first box of type `kind` (the 4-byte size comes before the type)."""
    return data.index(kind) - 4


def stream_info(video: bytes) -> tuple[int, int | None, float | None, float]:
    """(stream.frames, container.duration µs, stream duration in s, average fps) as PyAV reads the header."""
    container = av.open(io.BytesIO(video))
    stream = container.streams.video[0]
    seconds = float(stream.duration * stream.time_base) if stream.duration is not None else None
    info = (stream.frames, container.duration, seconds, float(stream.average_rate))
    container.close()
    return info


@pytest.fixture(scope="module")
def references(clips: dict[str, bytes]) -> dict[str, tuple[int, dict[int, tuple[tuple[int, ...], np.ndarray]]]]:
    """One full reference decode per long clip (bigbuckbunny alone is ~1 s and ~365 MB)."""
    return {name: reference(clips[name], (LONG_F, SHORT_F)) for name in ("bigbuckbunny", "bikes", "carphone")}


# ----------------------------------------------------------------------------- sample_frames: real clips


@pytest.mark.parametrize("count", [LONG_F, SHORT_F])
@pytest.mark.parametrize("name", ["bikes", "carphone", "bigbuckbunny"])
def test_sample_frames_equals_reference(clips: dict[str, bytes], references: dict, name: str, count: int) -> None:
    total, height, width = CLIP_GEOMETRY[name]
    ref_total, picked = references[name]
    assert ref_total == total
    indices, expected = picked[count]
    assert expected.shape == (count, height, width, 3)
    assert indices[0] == 0 and indices[-1] == total - 1
    assert len(set(indices)) == count  # T > F: no frame repeats

    assert_matches(sample_frames(clips[name], count), total, indices, expected)


def test_sample_frames_shorter_clip_repeats_frames(clips: dict[str, bytes]) -> None:
    total, height, width = CLIP_GEOMETRY["sample_1080p"]
    ref_total, picked = reference(clips["sample_1080p"], (LONG_F,))
    indices, expected = picked[LONG_F]
    assert ref_total == total
    # fmt: off
    assert indices == (
        0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 8, 9, 10, 10, 11,
        12, 12, 13, 14, 14, 15, 16, 16, 17, 18, 19, 19, 20, 21, 21, 22,
    )
    # fmt: on
    assert len(set(indices)) == total  # every source frame is used, 10 of them twice
    assert expected.shape == (LONG_F, height, width, 3)

    assert_matches(sample_frames(clips["sample_1080p"], LONG_F), total, indices, expected)


def test_sample_frames_five_frame_cut(clips: dict[str, bytes]) -> None:
    """5 frames to 17: linspace(0, 4, 17) rounds half to even, so frame 2 is used five times."""
    video = cut_clip(clips["bikes"], FEW_FRAMES)
    ref_total, picked = reference(video, (SHORT_F,))
    indices, expected = picked[SHORT_F]
    assert ref_total == FEW_FRAMES
    assert indices == (0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4)

    clip = sample_frames(video, SHORT_F)
    assert_matches(clip, FEW_FRAMES, indices, expected)
    assert all(np.array_equal(clip.frames[6], clip.frames[k]) for k in range(7, 11))
    assert not np.array_equal(clip.frames[5], clip.frames[6])


def test_sample_frames_one_frame(clips: dict[str, bytes]) -> None:
    """F=1 is the first frame (linspace(0, T-1, 1) == [0])."""
    clip = sample_frames(clips["carphone"], 1)
    assert clip.indices == (0,)
    assert clip.source_frames == CARPHONE_FRAMES
    assert np.array_equal(clip.frames, decode_all(clips["carphone"])[0][None])


# ----------------------------------------------------------------------------- containers whose frame count is wrong


@pytest.mark.parametrize(
    "rewrap",
    [lambda v: remux(v, "matroska"), annexb],
    ids=["matroska (no frame count in its header)", "raw h264 (no header at all)"],
)
def test_containers_without_a_frame_count(clips: dict[str, bytes], rewrap: Callable[[bytes], bytes]) -> None:
    """PyAV says 0 frames for these; the clip still samples right."""
    video = rewrap(clips["carphone"])
    frames_in_header, _, _, _ = stream_info(video)
    assert frames_in_header == 0
    total, picked = reference(video, (SHORT_F,))
    assert total == CARPHONE_FRAMES
    indices, expected = picked[SHORT_F]

    assert_matches(sample_frames(video, SHORT_F), total, indices, expected)


def test_mp4_header_durations_lie(clips: dict[str, bytes]) -> None:
    """mvhd, tkhd and mdhd durations divided by 10: the header says 0.4 s (12 frames); 120 frames decode."""
    original = clips["carphone"]
    patched = bytearray(original)
    # version-0 boxes: size, type, version+flags, then mvhd/mdhd: ctime, mtime, timescale, duration;
    # tkhd: ctime, mtime, track id, reserved, duration.
    for kind, duration_at in ((b"mvhd", 24), (b"mdhd", 24), (b"tkhd", 28)):
        box = mp4_box(patched, kind)
        assert patched[box + 8] == 0  # version 0: 32-bit fields
        (duration,) = struct.unpack_from(">I", patched, box + duration_at)
        struct.pack_into(">I", patched, box + duration_at, duration // DURATION_SCALE)
    video = bytes(patched)

    frames_before, container_us_before, seconds_before, fps = stream_info(original)
    frames_after, container_us, seconds, fps_after = stream_info(video)
    assert fps == fps_after == pytest.approx(30000 / 1001)
    assert round(seconds_before * fps) == round(container_us_before / 1e6 * fps) == CARPHONE_FRAMES
    header_frames = CARPHONE_FRAMES // DURATION_SCALE
    assert round(seconds * fps) == header_frames  # the stream duration lies ...
    assert round(container_us / 1e6 * fps) == header_frames  # ... and so does the container's
    assert frames_before == frames_after == CARPHONE_FRAMES  # (the sample table is intact)

    total, picked = reference(video, (SHORT_F,))
    assert total == CARPHONE_FRAMES  # the real count, ten times the header's
    indices, expected = picked[SHORT_F]
    assert indices[-1] == CARPHONE_FRAMES - 1

    assert_matches(sample_frames(video, SHORT_F), total, indices, expected)


def edit_list_start(video: bytes, media_time: int) -> bytes:
    """carphone with its one edit list entry starting the presentation at `media_time`."""
    patched = bytearray(video)
    box = mp4_box(patched, b"elst")
    assert patched[box + 8] == 0  # version 0
    assert struct.unpack_from(">I", patched, box + 12) == (1,)  # one entry
    # entry: segment_duration (u32), media_time (s32), rate (2 x s16)
    assert struct.unpack_from(">i", patched, box + 20) == (CARPHONE_EDIT_START,)
    struct.pack_into(">i", patched, box + 20, media_time)
    return bytes(patched)


def test_edit_list_makes_stream_frames_wrong(clips: dict[str, bytes]) -> None:
    """An edit list that starts 5 frames later: the sample table (and so `stream.frames`) still says 120,
    every packet is still demuxed, but FFmpeg drops the 5 hidden frames after decoding: 115 frames play.

    This is the case where the packet count itself is wrong, so sample_frames must take its second pass."""
    original = clips["carphone"]
    video = edit_list_start(original, CARPHONE_EDIT_START + HIDDEN_BY_EDIT * CARPHONE_TICKS_PER_FRAME)
    frames_in_header, _, _, _ = stream_info(video)
    assert frames_in_header == CARPHONE_FRAMES
    shown = decode_all(video)
    assert len(shown) == CARPHONE_FRAMES - HIDDEN_BY_EDIT
    all_frames = decode_all(original)
    assert all(np.array_equal(a, b) for a, b in zip(shown, all_frames[HIDDEN_BY_EDIT:], strict=True))

    indices, expected = pick(shown, SHORT_F)
    assert indices[-1] == CARPHONE_FRAMES - HIDDEN_BY_EDIT - 1

    assert_matches(sample_frames(video, SHORT_F), len(shown), indices, expected)


def test_edit_list_hiding_every_frame_is_no_frames(clips: dict[str, bytes]) -> None:
    video = edit_list_start(clips["carphone"], 4 * CARPHONE_FRAMES * CARPHONE_TICKS_PER_FRAME)
    assert stream_info(video)[0] == CARPHONE_FRAMES
    assert decode_all(video) == []
    with pytest.raises(MediaError) as err:
        sample_frames(video, SHORT_F)
    assert err.value.reason == "no_frames"


def decode_until_error(video: bytes) -> tuple[list[np.ndarray], bool]:
    """The frames PyAV decodes (one thread) before the decoder gives up, and whether it reported an error."""
    container = av.open(io.BytesIO(video))
    frames = []
    try:
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
    except av.FFmpegError:
        return frames, True
    finally:
        container.close()
    return frames, False


def half_faststart_carphone(clips: dict[str, bytes]) -> bytes:
    whole = faststart(clips["carphone"])
    assert whole.index(b"moov") < whole.index(b"mdat")
    return whole[: len(whole) // 2]


def test_truncated_faststart_mp4(clips: dict[str, bytes]) -> None:
    """moov first, media cut at half: the header promises 120 frames, 59 packets are left and 56 frames
    decode before the decoder reports invalid data in the half-written packet. sample_frames either
    refuses the file (video_decode_error) or gives exactly the frames that decode; nothing else."""
    video = half_faststart_carphone(clips)
    assert stream_info(video)[0] == CARPHONE_FRAMES
    frames, reported = decode_until_error(video)
    assert reported  # a single-threaded decoder does report the damage ...
    assert 0 < len(frames) <= CARPHONE_FRAMES // 2  # ... after the frames before it
    indices, expected = pick(frames, SHORT_F)
    try:
        clip = sample_frames(video, SHORT_F)
    except MediaError as exc:
        assert exc.reason == "video_decode_error"
    else:
        assert_matches(clip, len(frames), indices, expected)


SAMPLE_ON_CPUS = """
import os, sys
os.sched_setaffinity(0, {cpus})
from infra.media.video import MediaError, sample_frames
try:
    print(sample_frames(sys.stdin.buffer.read(), {count}).source_frames)
except MediaError as exc:
    print(exc.reason)
"""


def test_truncated_mp4_result_does_not_depend_on_the_cpu_count(clips: dict[str, bytes]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs to compare with 1")
    video = half_faststart_carphone(clips)
    runs = {
        n: subprocess.Popen(
            [sys.executable, "-c", SAMPLE_ON_CPUS.format(cpus=set(cpus[:n]), count=SHORT_F)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for n in (1, 2)
    }
    results = {n: run.communicate(video, timeout=120)[0].decode().strip() for n, run in runs.items()}
    assert all(run.returncode == 0 for run in runs.values())
    assert results[1] == results[2], results


def test_truncated_mp4_with_index_at_the_end_is_a_decode_error(clips: dict[str, bytes]) -> None:
    """bigbuckbunny keeps its moov at the end: half the file has no index, so nothing can be opened."""
    video = clips["bigbuckbunny"]
    assert video.index(b"mdat") < video.index(b"moov")
    half = video[: len(video) // 2]
    with pytest.raises(av.FFmpegError):
        av.open(io.BytesIO(half))
    with pytest.raises(MediaError) as err:
        sample_frames(half, SHORT_F)
    assert err.value.reason == "video_decode_error"


def test_resolution_change_mid_stream_is_an_input_error(clips: dict[str, bytes]) -> None:
    """Two real H.264 streams back to back (``cat a.h264 b.h264``): 176x144 then 640x272."""
    video = annexb(clips["carphone"]) + annexb(clips["bikes"])
    sizes = {frame.shape[:2] for frame in decode_all(video)}
    assert sizes == {(144, 176), (272, 640)}
    try:
        clip = sample_frames(video, SHORT_F)
    except MediaError as exc:  # a clear refusal is fine ...
        assert exc.reason == "variable_resolution"
    else:  # ... and so is one consistent frame size
        assert clip.frames.shape[0] == SHORT_F


# ----------------------------------------------------------------------------- bad inputs


def image_bytes(clips: dict[str, bytes], fmt: str) -> bytes:
    """carphone's first frame saved by Pillow in `fmt` (what a still image renamed .mp4 holds)."""
    out = io.BytesIO()
    Image.fromarray(decode_all(cut_clip(clips["carphone"], 1))[0]).save(out, format=fmt)
    return out.getvalue()


BAD_INPUTS: dict[str, tuple[Callable[[dict[str, bytes]], bytes], str]] = {
    "zero_bytes": (lambda clips: b"", "empty_video"),
    "random_bytes": (
        lambda clips: np.random.default_rng(0).integers(0, 256, NOISE_BYTES, dtype=np.uint8).tobytes(),
        "video_decode_error",
    ),
    "png_named_mp4": (lambda clips: image_bytes(clips, "PNG"), "not_a_video"),
    "jpeg_named_mp4": (lambda clips: image_bytes(clips, "JPEG"), "not_a_video"),
    "audio_only": (lambda clips: clips["audio_only"], "no_video_stream"),
    "truncated_mkv": (lambda clips: clips["truncated_mkv"], "video_decode_error"),
    # sample_1080p keeps moov first, but its first key frame alone is 281 kB: cut at half, no frame decodes
    # and the decoder reports invalid data.
    "half_of_sample_1080p": (
        lambda clips: clips["sample_1080p"][: len(clips["sample_1080p"]) // 2],
        "video_decode_error",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_a_media_error(clips: dict[str, bytes], case: str) -> None:
    make, reason = BAD_INPUTS[case]
    data = make(clips)
    with pytest.raises(MediaError) as err:
        sample_frames(data, SHORT_F)
    assert err.value.reason == reason
    assert isinstance(err.value, InputError)


def test_bad_inputs_really_are_what_they_claim(clips: dict[str, bytes]) -> None:
    """The hostile inputs above are what their names say, as PyAV sees them."""
    with pytest.raises(av.error.EOFError):
        av.open(io.BytesIO(clips["truncated_mkv"]))
    container = av.open(io.BytesIO(clips["audio_only"]))
    assert [s.type for s in container.streams] == ["audio"]
    container.close()
    for fmt, demuxer in (("PNG", "png_pipe"), ("JPEG", "jpeg_pipe")):
        container = av.open(io.BytesIO(image_bytes(clips, fmt)))
        assert container.format.name == demuxer
        container.close()


@pytest.mark.parametrize("fmt", ["PPM", "JPEG2000", "QOI"])
def test_other_still_images_are_not_videos(clips: dict[str, bytes], fmt: str) -> None:
    with pytest.raises(MediaError) as err:
        sample_frames(image_bytes(clips, fmt), SHORT_F)
    assert err.value.reason == "not_a_video"


# ----------------------------------------------------------------------------- frames_to_pixels


def reference_pixels(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    x = torch.from_numpy(frames).float() / 127.5 - 1
    x = x.permute(0, 3, 1, 2)
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    return x.permute(1, 0, 2, 3).unsqueeze(0)


@pytest.mark.parametrize("name", ["carphone", "bikes"])
def test_frames_to_pixels_equals_reference(references: dict, name: str) -> None:
    _, picked = references[name]
    _, frames = picked[SHORT_F]
    pixels = frames_to_pixels(frames, PIXEL_HEIGHT, PIXEL_WIDTH)
    assert pixels.shape == (1, 3, SHORT_F, PIXEL_HEIGHT, PIXEL_WIDTH)
    assert pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1
    assert torch.equal(pixels, reference_pixels(frames, PIXEL_HEIGHT, PIXEL_WIDTH))


def test_frames_to_pixels_same_size_is_the_normalised_frames(references: dict) -> None:
    """No resize: every value is exactly pixel/127.5 - 1 at (channel, frame, row, column)."""
    _, picked = references["carphone"]
    _, frames = picked[SHORT_F]
    _, height, width = CLIP_GEOMETRY["carphone"]
    pixels = frames_to_pixels(frames, height, width)
    assert pixels.shape == (1, 3, SHORT_F, height, width)
    expected = torch.from_numpy(frames.transpose(3, 0, 1, 2).copy()).float() / 127.5 - 1
    assert torch.equal(pixels[0], expected)
    assert pixels.is_contiguous()


# ----------------------------------------------------------------------------- decode_prompt


@pytest.mark.parametrize(
    ("raw", "reason"),
    [(None, "missing_prompt"), (b"", "empty_prompt"), (b"  \n", "empty_prompt"), (b"\xff\xfe bad", "prompt_not_utf8")],
)
def test_decode_prompt_refuses(raw: bytes | None, reason: str) -> None:
    with pytest.raises(InputError) as err:
        decode_prompt(raw)
    assert err.value.reason == reason


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"A rabbit.", "A rabbit."),
        (b"  \tA rabbit climbs out.\r\n", "A rabbit climbs out."),
        (b"\xef\xbb\xbfA rabbit.\n", "A rabbit."),
        ("\ufeff  Un chat noir — 猫 \n".encode(), "Un chat noir — 猫"),
        (b"line one\nline two\n", "line one\nline two"),
    ],
)
def test_decode_prompt_strips(raw: bytes, text: str) -> None:
    assert decode_prompt(raw) == text


def test_decode_prompt_bom_only_is_empty() -> None:
    with pytest.raises(InputError) as err:
        decode_prompt(b"\xef\xbb\xbf \n")
    assert err.value.reason == "empty_prompt"
