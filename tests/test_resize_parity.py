"""Each format's frames are its consumer's own, bit for bit, on the sizes people have (a 1366×768 TV rip, 720×480
DVD, a 1080×1920 phone clip, tiny sizes) and every bucket the recipe yields:

* ``musubi``: musubi-tuner is not on PyPI; its ``resize_image_to_bucket`` is restated here (`_musubi_reference`) from
  ``src/musubi_tuner/dataset/media_utils.py`` at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7, along the branch
  its ``load_video`` takes (a PIL image from PyAV's ``frame.to_image()``), running the libraries it runs: Pillow's
  LANCZOS when it enlarges and opencv-python-headless's ``INTER_AREA`` when it shrinks; then its
  ``wan_cache_latents.py`` scaling ``x / 127.5 - 1``;
* ``diffsynth``: the released ``diffsynth`` 2.1.12 package's own ``ImageCropAndResize`` operator (torchvision's
  ``resize`` and ``center_crop`` from torchvision's wheel, on the PIL image) and its pipeline's own
  ``preprocess_video`` (`tests.diffsynth_ref`).

Frames are synthetic (a smooth pattern with detail, so every kernel's weights show), made at each size; one
end-to-end build per consumer is in tests/test_musubi.py and tests/test_diffsynth.py.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from infra.media.buckets import choose_musubi_bucket, musubi_buckets
from infra.media.resize import musubi_frame, resize_pixels
from tests import diffsynth_ref as ds

#: (width, height) of the sources: TV rip, DVD, portrait phone, landscape 1080p, a small clip, tiny ones.
SOURCES = ((1366, 768), (720, 480), (1080, 1920), (1920, 1080), (176, 144), (40, 24), (17, 31))
#: The musubi-wan recipe's resolution (--width/--height): every bucket its BucketSelector makes of it.
MUSUBI_RESOLUTION = (832, 480)
#: DiffSynth's fixed height×width per dataset: the Wan examples' 480×832, its portrait, and small ones.
DIFFSYNTH_SIZES = ((480, 832), (832, 480), (64, 96), (48, 80), (16, 16))


def _frame(width: int, height: int, seed: int = 0) -> np.ndarray:
    """An (H, W, 3) uint8 frame: gradients, rings and noise (no flat areas a kernel's weights vanish in)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rings = np.sin(np.hypot(x - width / 3, y - height / 2) / max(2.0, min(width, height) / 40))
    noise = np.random.default_rng(seed).integers(0, 48, (height, width, 3))
    base = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1), 127 + 100 * rings], axis=-1)
    return np.clip(base * 0.8 + noise, 0, 255).astype(np.uint8)


def _musubi_reference(image: Image.Image, bucket: tuple[int, int]) -> np.ndarray:
    """musubi's ``resize_image_to_bucket(image, bucket)`` for a PIL image (its ``load_video`` branch), restated."""
    if bucket == image.size:
        return np.array(image)
    scale = max(bucket[0] / image.size[0], bucket[1] / image.size[1])
    size = (int(image.size[0] * scale + 0.5), int(image.size[1] * scale + 0.5))  # round half up
    if scale > 1:
        array = np.array(image.resize(size, Image.LANCZOS))
    else:
        array = cv2.resize(np.array(image), size, interpolation=cv2.INTER_AREA)
    left, top = (size[0] - bucket[0]) // 2, (size[1] - bucket[1]) // 2
    return array[top : top + bucket[1], left : left + bucket[0]]


def _pixels(array: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 → (3, H, W) float32 as musubi scales it (``contents / 127.5 - 1.0``)."""
    return torch.from_numpy(array).permute(2, 0, 1).float() / 127.5 - 1.0


@pytest.mark.parametrize(("width", "height"), SOURCES)
def test_musubi_frames_are_its_resize_image_to_bucket(width, height):
    """The bucket its BucketSelector picks for the size and the recipe's extreme buckets (every bucket: below), the
    frames musubi_frame makes equal to its own, and the pixels its scaling of them."""
    frame = _frame(width, height)
    buckets = musubi_buckets(*MUSUBI_RESOLUTION, 1)
    chosen = choose_musubi_bucket(buckets, 1, height, width)
    for bucket in {buckets[0], buckets[-1], chosen}:
        theirs = _musubi_reference(Image.fromarray(frame), (bucket.width, bucket.height))
        assert np.array_equal(musubi_frame(frame, bucket.height, bucket.width), theirs), (width, height, bucket)
    ours = resize_pixels(frame[None], chosen.height, chosen.width, "musubi")[0, :, 0]
    assert torch.equal(ours, _pixels(_musubi_reference(Image.fromarray(frame), (chosen.width, chosen.height))))


@pytest.mark.parametrize(("width", "height"), [(1366, 768), (40, 24)])
def test_musubi_frames_on_every_bucket_the_recipe_yields(width, height):
    """Every bucket of the musubi-wan recipe's resolution, from a source it shrinks to all (INTER_AREA) and one it
    enlarges to all (LANCZOS)."""
    frame = _frame(width, height, seed=3)
    buckets = musubi_buckets(*MUSUBI_RESOLUTION, 1)
    assert len(buckets) > 30
    for bucket in buckets:
        theirs = _musubi_reference(Image.fromarray(frame), (bucket.width, bucket.height))
        assert np.array_equal(musubi_frame(frame, bucket.height, bucket.width), theirs), bucket


def test_musubi_frames_of_a_size_equal_to_the_bucket_and_of_both_directions():
    """The identity (a frame the bucket's size is not resampled), a 2× and a 1.5× shrink (INTER_AREA's integer and
    fractional paths) and an enlargement (LANCZOS)."""
    for width, height, bucket in ((832, 480, (832, 480)), (1664, 960, (832, 480)), (1248, 720, (832, 480))):
        frame = _frame(width, height, seed=1)
        ours = resize_pixels(frame[None], bucket[1], bucket[0], "musubi")[0, :, 0]
        assert torch.equal(ours, _pixels(_musubi_reference(Image.fromarray(frame), bucket)))
    small = _frame(100, 60, seed=2)
    assert torch.equal(
        resize_pixels(small[None], 480, 832, "musubi")[0, :, 0],
        _pixels(_musubi_reference(Image.fromarray(small), (832, 480))),
    )


@pytest.fixture(scope="module")
def diffsynth():
    return ds.diffsynth()


@pytest.mark.parametrize(("width", "height"), SOURCES)
def test_diffsynth_frames_are_its_own_crop_and_resize_and_preprocess(diffsynth, width, height):
    frame = Image.fromarray(_frame(width, height))
    pipe = diffsynth.wan_video.WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    for target_h, target_w in DIFFSYNTH_SIZES:
        (cropped,) = ds.crop_resize([frame], target_h, target_w)  # its ImageCropAndResize, torchvision's ops
        theirs = pipe.preprocess_video([cropped])[0, :, 0]  # its own value scaling
        ours = resize_pixels(np.asarray(frame)[None], target_h, target_w, "diffsynth")[0, :, 0]
        assert torch.equal(ours, theirs), (width, height, target_w, target_h)


def test_the_older_policies_were_not_the_consumers_and_the_new_ones_are():
    """What the issue measured: the previous policies (cover-crop for musubi, cover-crop-aa for DiffSynth) are
    tens of dB from the consumers' own frames on a 1366×768 source; the named policies are exactly theirs."""
    frame = _frame(1366, 768)
    theirs = _pixels(_musubi_reference(Image.fromarray(frame), (832, 480)))
    before = resize_pixels(frame[None], 480, 832, "cover-crop")[0, :, 0]
    after = resize_pixels(frame[None], 480, 832, "musubi")[0, :, 0]
    assert _psnr(before, theirs) < 45 and torch.equal(after, theirs)


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a - b) / 2).pow(2).mean().item()  # values in [-1, 1]: a peak of 2
    return float("inf") if mse == 0 else 10 * np.log10(1 / mse)


def test_in_a_bf16_run_the_pixels_are_scaled_in_bf16_as_the_consumers_scale_them(diffsynth):
    """musubi scales ``contents.to(vae.dtype) / 127.5 - 1`` and DiffSynth ``x.to(torch_dtype) * (2/255) - 1``: in a
    bf16 run (``--dtype bf16``) half the pixel values land one bf16 step from a float32 scaling cast afterwards; the
    policies scale in the run's dtype, so the VAE gets their exact inputs."""
    frame = _frame(720, 480)
    array = _musubi_reference(Image.fromarray(frame), (832, 480))
    theirs = torch.from_numpy(array).permute(2, 0, 1).to(torch.bfloat16) / 127.5 - 1.0
    ours = resize_pixels(frame[None], 480, 832, "musubi", dtype=torch.bfloat16)[0, :, 0]
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs.float())
    assert not torch.equal(ours.to(torch.bfloat16), _pixels(array).to(torch.bfloat16))  # the cast-after numbers differ
    pipe = diffsynth.wan_video.WanVideoPipeline(device="cpu", torch_dtype=torch.bfloat16)
    theirs = pipe.preprocess_video(ds.crop_resize([Image.fromarray(frame)], 480, 832))[0, :, 0]
    ours = resize_pixels(frame[None], 480, 832, "diffsynth", dtype=torch.bfloat16)[0, :, 0]
    assert theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs.float())
