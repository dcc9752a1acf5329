"""Pixels made in chunks of frames are the whole-tensor recipe's numbers, bit for bit (real clips)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infra.media import resize, video
from infra.media.resize import IMAGE_ONLY_POLICIES, RESIZE_POLICIES, resize_pixels
from infra.media.video import head_frames, pick_frames, sample_frames

FRAMES, HEIGHT, WIDTH = 9, 48, 80

#: The resize policies of clips (`torchvision` is the image family's, on PIL stills: tests/test_torchvision_parity.py).
VIDEO_POLICIES = sorted(set(RESIZE_POLICIES) - IMAGE_ONLY_POLICIES)


def _whole_stretch(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """The reference recipe in one call: /127.5-1, bilinear, align_corners=False (latentforge 0.1's code)."""
    x = torch.from_numpy(frames).float() / 127.5 - 1.0
    x = F.interpolate(x.permute(0, 3, 1, 2), size=(height, width), mode="bilinear", align_corners=False)
    return x.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


@pytest.mark.parametrize("name", ["bikes", "sample_1080p"])
def test_chunked_pixels_equal_the_whole_tensor(clips: dict[str, bytes], name: str) -> None:
    frames = sample_frames(clips[name], FRAMES).frames
    assert torch.equal(resize_pixels(frames, HEIGHT, WIDTH, "stretch", chunk=2), _whole_stretch(frames, HEIGHT, WIDTH))
    for policy in VIDEO_POLICIES:
        whole = resize_pixels(frames, HEIGHT, WIDTH, policy, chunk=FRAMES)
        for chunk in (1, 4):
            chunked = resize_pixels(frames, HEIGHT, WIDTH, policy, chunk=chunk)
            assert chunked.is_contiguous() and chunked.shape == (1, 3, FRAMES, HEIGHT, WIDTH)
            assert torch.equal(chunked, whole), (policy, chunk)


def test_a_chunk_below_one_is_refused(clips: dict[str, bytes]) -> None:
    frames = sample_frames(clips["carphone"], 2).frames
    with pytest.raises(ValueError, match="chunk"):
        resize_pixels(frames, HEIGHT, WIDTH, "stretch", chunk=0)


def test_frames_are_decoded_into_one_array_in_the_asked_order(clips: dict[str, bytes]) -> None:
    """Repeated indices (a clip shorter than F), a head, and a picked order with repeats: each frame is the
    decoder's frame at that index."""
    data = clips["carphone"]  # 120 frames
    every = head_frames(data, 120).frames
    short = sample_frames(clips["sample_1080p"], 30)  # 23 frames → repeats
    assert len(short.indices) == 30 and len(set(short.indices)) == 23
    assert np.array_equal(short.frames[0], short.frames[1]) or short.indices[0] != short.indices[1]
    picked = pick_frames(data, lambda total, fps: (5, 3, 3, 119))
    assert picked.indices == (5, 3, 3, 119)
    assert np.array_equal(picked.frames, every[[5, 3, 3, 119]])
    spread = sample_frames(data, FRAMES)
    assert np.array_equal(spread.frames, every[list(spread.indices)])


def test_the_chunks_share_one_source_resolution_float_buffer(clips: dict[str, bytes], monkeypatch) -> None:
    """Each chunk's float frames are written into the same buffer (no fresh ~100 MB tensor per 1080p chunk)."""
    frames = sample_frames(clips["sample_1080p"], FRAMES).frames
    seen: list[int] = []
    real = resize._stretch_chunk
    monkeypatch.setattr(resize, "_stretch_chunk", lambda x, h, w: seen.append(x.data_ptr()) or real(x, h, w))
    pixels = resize_pixels(frames, HEIGHT, WIDTH, "stretch", chunk=2)
    assert len(seen) == (FRAMES + 1) // 2 and len(set(seen)) == 1
    assert torch.equal(pixels, _whole_stretch(frames, HEIGHT, WIDTH))


@pytest.mark.parametrize("policy", VIDEO_POLICIES)
def test_pixels_made_while_decoding_equal_the_chunked_pixels_of_the_kept_frames(clips, policy) -> None:
    """`PixelTarget`: each picked frame made into its rows as it is decoded, with no (F, H, W, 3) source-resolution
    array. Repeated rows (a clip shorter than F), a picked order with repeats and a short head clip, bit for bit."""
    target = video.PixelTarget(HEIGHT, WIDTH, policy)
    short = sample_frames(clips["sample_1080p"], 30, target=target)  # 23 frames → repeats
    frames = sample_frames(clips["sample_1080p"], 30).frames
    assert short.frames.size == 0 and short.count == 30 and short.source_height == 1080
    assert torch.equal(short.pixels, resize_pixels(frames, HEIGHT, WIDTH, policy))

    def choose(total: int, fps: float) -> tuple[int, ...]:
        return (5, 3, 3, total - 1)

    picked = pick_frames(clips["carphone"], choose, target=target)
    assert picked.indices == (5, 3, 3, 119) and picked.pixels.is_contiguous()
    every = head_frames(clips["carphone"], 120).frames
    assert torch.equal(picked.pixels, resize_pixels(every[[5, 3, 3, 119]], HEIGHT, WIDTH, policy))


def test_pixels_made_while_decoding_refuse_a_clip_whose_frames_change_size(clips) -> None:
    """The variable-resolution check holds on the pixel path too (it sees every decoded frame's shape)."""
    picked = video._PickedPixels(2, video.PixelTarget(HEIGHT, WIDTH))
    frame = sample_frames(clips["carphone"], 1).frames[0]
    picked.put(0, [0], frame)
    picked.put(1, [1], frame[:100])
    with pytest.raises(video.MediaError, match="differ in size"):
        picked.check_sizes()
