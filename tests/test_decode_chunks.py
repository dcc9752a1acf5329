"""Decode-and-verify in chunks: streamed scoring against whole-tensor scoring, the Wan VAE's chunked decode against
its whole decode, and the streamed comparison's files and checks.

What holds how: scoring in frame chunks is bit-identical to scoring the whole tensor (every frame is reduced on
its own, in order), and within 1e-12 of the float64 conv2d SSIM this module replaced; the Wan decode's chunks are
the VAE's own `decode` bit for bit, and a frame over the limit is decoded in tiles with a tile's activations."""

from __future__ import annotations

import io
import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from infra.audit import metrics
from infra.audit.compare import compare, strip_picks, to_uint8
from infra.models import load_family
from infra.models.wan_decode import decode_video, latent_spans
from tests.conftest import HEIGHT, WIDTH

SHAPE = (3, 9, 40, 57)  # an odd width and a frame count no chunk size divides
CHUNKS = (1, 2, 4, 9)
LATENT_FRAMES = 4  # 13 pixel frames: the first-frame path, then three 4-frame calls


def _pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    video = torch.rand(SHAPE, generator=gen, dtype=torch.float64) * 1.6 - 0.8
    return video, (video + 0.2 * torch.randn(SHAPE, generator=gen, dtype=torch.float64)).clamp(-1, 1)


def _conv2d_ssim(reference: torch.Tensor, test: torch.Tensor) -> float:
    """The SSIM as it was computed before streaming: whole tensor, float64 'valid' conv2d, one sum."""
    g = metrics.gaussian_window(metrics.WINDOW)
    x, y = (((v + 1) / 2).reshape(-1, 1, *v.shape[-2:]) for v in (reference, test))

    def blur(images: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.conv2d(images, g.view(1, 1, -1, 1)), g.view(1, 1, 1, -1))

    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x**2, blur(y * y) - mu_y**2, blur(x * y) - mu_x * mu_y
    c1, c2 = (metrics.K1 * metrics.DATA_RANGE) ** 2, (metrics.K2 * metrics.DATA_RANGE) ** 2
    ratio = (2 * mu_x * mu_y + c1) * (2 * cov + c2) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(ratio.mean())


def test_scoring_in_frame_chunks_is_whole_tensor_scoring_bit_for_bit():
    reference, test = _pair(0)
    whole = (metrics.psnr(reference, test), metrics.ssim(reference, test))
    for chunk in CHUNKS:
        score = metrics.VideoScore()
        for start in range(0, SHAPE[1], chunk):
            score.add(reference[:, start : start + chunk], test[:, start : start + chunk])
        assert (score.psnr, score.ssim) == whole, chunk
    mse = float(torch.mean(((reference - test) / 2) ** 2))
    assert whole[0] == pytest.approx(10 * math.log10(1 / mse), rel=1e-12)
    assert whole[1] == pytest.approx(_conv2d_ssim(reference, test), rel=1e-12)
    assert 0.3 < whole[1] < 0.95  # far from the trivial 1.0


def test_scoring_strips_do_not_change_the_numbers(monkeypatch):
    reference, test = _pair(1)
    expected = _conv2d_ssim(reference, test)
    for rows in (1, 7, 64):  # one row per strip, a strip size that does not divide the rows, one strip
        monkeypatch.setattr(metrics, "STRIP_ROWS", rows)
        assert metrics.ssim(reference, test) == pytest.approx(expected, rel=1e-12), rows
        assert metrics.ssim(reference, reference.clone()) == 1.0


def test_a_chunk_must_continue_the_frames_before():
    reference, test = _pair(2)
    score = metrics.VideoScore()
    score.add(reference[:, :2], test[:, :2])
    with pytest.raises(ValueError, match="does not continue"):
        score.add(reference[:, 2:, :20], test[:, 2:, :20])
    with pytest.raises(ValueError, match="no frames scored"):
        _ = metrics.VideoScore().ssim


def test_latent_spans_take_the_first_frame_alone():
    assert latent_spans(9, 2) == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9)]
    assert latent_spans(9, 1) == [(0, 1)] + [(i, i + 1) for i in range(1, 9)]
    assert latent_spans(4, 8) == [(0, 1), (1, 4)] and latent_spans(1, 2) == [(0, 1)]
    with pytest.raises(ValueError, match="chunk"):
        latent_spans(3, 0)


@pytest.fixture(scope="module")
def wan(tiny_model: Path):
    """The tiny Wan2.2 family, loaded once for the module."""
    return load_family(tiny_model, "wan22", torch.device("cpu"), torch.float32)


def test_wan_decode_chunks_are_the_whole_decode_bit_for_bit(wan):
    family = wan
    shape = (family.vae.config.z_dim, LATENT_FRAMES, HEIGHT // 16, WIDTH // 16)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = family.decode(latents)
    assert whole.shape == (3, 1 + 4 * (LATENT_FRAMES - 1), HEIGHT, WIDTH)
    assert torch.equal(family.vae.decode(_unnormalised(family, latents)).sample[0], whole)  # diffusers' own call
    for chunk in (2, 3):  # the default, and one that does not divide the frames
        parts = list(family.decode_chunks(latents, chunk=chunk))
        assert [c.shape[1] for c in parts] == [1] + [4 * (b - a) for a, b in latent_spans(LATENT_FRAMES, chunk)[1:]]
        assert torch.equal(torch.cat(parts, dim=1), whole), chunk
    assert torch.equal(family.decode(latents), whole)  # the feature cache was cleared: the next decode is the same


def _unnormalised(family, latents: torch.Tensor) -> torch.Tensor:
    return latents.float().unsqueeze(0) * family.std + family.mean


def _largest_activation(vae, decode) -> tuple[int, torch.Tensor]:
    """`decode()`'s pixels and the most elements any of the VAE decoder's modules returned on the way (the memory a
    decode needs scales with it), read through public forward hooks."""
    largest = [0]

    def seen(_module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            largest[0] = max(largest[0], output.numel())

    hooks = [m.register_forward_hook(seen) for m in vae.decoder.modules()]
    try:
        pixels = decode()
    finally:
        for hook in hooks:
            hook.remove()
    return largest[0], pixels


def test_wan_decode_of_a_frame_over_the_limit_is_tiled_in_bounded_memory(wan):
    family = wan
    latents = torch.randn((family.vae.config.z_dim, 1, 4, 8), generator=torch.Generator().manual_seed(4))
    z = _unnormalised(family, latents)
    pixels = torch.rand((1, 3, 1, 64, 128), generator=torch.Generator().manual_seed(5)) * 2 - 1
    encoded = family.encode_video(pixels)
    whole_peak, whole = _largest_activation(family.vae, lambda: decode_video(family.vae, z))
    tile = (64, 32)  # a 64² tile every 32 pixels: 8 tiles over the 64×128 frame
    tiled_peak, tiled = _largest_activation(
        family.vae, lambda: decode_video(family.vae, z, max_area=64 * 64, tile=tile)
    )
    assert tiled.shape == whole.shape == (1, 3, 1, 64, 128) and float(tiled.abs().max()) <= 1.0
    assert not torch.equal(tiled, whole)  # the tiles were blended: another decode
    assert tiled_peak * (64 * 128) <= whole_peak * 64 * 64  # a tile's activations, not the frame's
    assert torch.equal(decode_video(family.vae, z, max_area=64 * 128), whole)  # a frame at the limit: whole
    assert torch.equal(family.encode_video(pixels), encoded)  # tiling was switched off again


def _mp4_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _smooth(seed: int) -> torch.Tensor:
    """A smooth video (what H.264 keeps near lossless at crf 15; random pixels it cannot)."""
    coarse = torch.rand((1, 3, SHAPE[1], 5, 8), generator=torch.Generator().manual_seed(seed))
    return F.interpolate(coarse, size=SHAPE[1:], mode="trilinear")[0] * 1.6 - 0.8


def test_compare_streams_the_whole_tensor_numbers_and_files():
    reference = _smooth(4)
    test = (reference + 0.1 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))).clamp(-1, 1)
    compared = compare(reference, iter([test[:, :1], test[:, 1:5], test[:, 5:]]))
    assert compared.score.psnr == metrics.psnr(reference, test) and compared.score.ssim == metrics.ssim(reference, test)
    picks = strip_picks(SHAPE[1])
    assert picks == [0, 4, 8]
    top, bottom = (np.concatenate(list(to_uint8(v[:, picks]).numpy()), axis=1) for v in (reference, test))
    assert np.array_equal(compared.strip, np.concatenate([top, bottom]))  # the strip is lossless
    png = np.asarray(Image.open(io.BytesIO(compared.strip_png())).convert("RGB"))
    assert np.array_equal(png, compared.strip)
    frames = _mp4_frames(compared.mp4)
    assert frames.shape == (SHAPE[1], SHAPE[2], 2 * SHAPE[3], 3)
    left = torch.from_numpy(frames[:, :, : SHAPE[3]]).permute(3, 0, 1, 2).float() / 127.5 - 1
    assert metrics.psnr(reference, left) > 30  # H.264 at crf 15: near lossless
    odd = compare(reference[:, :, :39], iter([test[:, :, :39]]))
    assert _mp4_frames(odd.mp4).shape[1] == 40 and odd.strip.shape == (2 * 39, 3 * SHAPE[3], 3)  # even height


def test_compare_refuses_frames_that_do_not_fit_and_closes_the_decoder():
    reference, test = (v.float() for v in _pair(5))
    closed = []

    def decoder(parts: list[torch.Tensor]):
        try:
            yield from parts
        finally:
            closed.append(True)

    cases = {
        "do not fit": [test[:, :2, :, :50]],
        "more than": [test[:, :5], test[:, 3:]],
        "is not the source": [test[:, :4]],
    }
    for message, parts in cases.items():
        with pytest.raises(ValueError, match=message):
            compare(reference, decoder(parts))
    assert len(closed) == len(cases)
