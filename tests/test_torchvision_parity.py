"""The image family's pixels are torchvision's, bit for bit: released ``torchvision==0.28.0`` (`tests.torchvision_ref`)
against the function the pipeline calls (`infra.media.image.prepare_image`, by way of
`infra.preprocess.prepare.prepare_video` and the plan's spec), on a few hundred seeded random image sizes,
EXIF-rotated JPEGs and palette PNGs with a transparent index among them.

Orientation and transparency are latentforge's loading (torchvision takes an RGB PIL image and does neither): the
reference opens the same bytes, turns them upright with ``ImageOps.exif_transpose`` and puts transparency over white
with Pillow's public calls, then runs torchvision's ``Resize(size, BICUBIC, antialias=True) → CenterCrop → ToTensor →
Normalize(0.5, 0.5)``. A family plugin's own preprocessing is recorded in the spec and used in place of the policy.
"""

from __future__ import annotations

import importlib
import io
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from flows.terminal_run import run_build
from infra.config import CacheSpec
from infra.demo.tiny_image import make_tiny_image
from infra.errors import ConfigError
from infra.media.image import prepare_image, resized_output_size
from infra.media.resize import RESIZE_POLICIES
from infra.plan import make_spec
from infra.preprocess.prepare import prepare_video
from infra.publish.base import parse_target
from infra.publish.card import dataset_card
from tests.conftest import config
from tests.image_media import sample_images, write_folder
from tests.test_family_plugins import PLUGIN
from tests.torchvision_ref import torchvision_transforms

#: Random sizes drawn (seeded); every fifth an EXIF-rotated JPEG, every fifth a palette PNG with transparency.
SIZES, SEED = 300, 29
#: The seed's square target, a small square one, and non-square ones (portrait and landscape).
SQUARE_TARGETS = (512, 64)
OBLONG_TARGETS = ((32, 48), (48, 32), (384, 512))
#: EXIF orientation tag and the values that rotate or mirror (1 is upright).
ORIENTATION, TURNS = 0x0112, (2, 3, 4, 5, 6, 7, 8)
#: zlib level of the test PNGs: the same pixels as the default 6, several times quicker to write.
PNG_LEVEL = 1


@pytest.fixture(scope="module")
def tv():
    return torchvision_transforms()[0]


def _picture(rng: random.Random, height: int, width: int) -> np.ndarray:
    """Smooth colour (a small random image enlarged) plus noise: real edges and gradients, quick to encode."""
    coarse = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR), dtype=np.int16)
    noise = np.random.default_rng(rng.randrange(2**32)).integers(-12, 13, smooth.shape, dtype=np.int16)
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def _encoded(rng: random.Random, index: int, height: int, width: int) -> tuple[bytes, str]:
    """(file bytes, kind): RGB PNG, EXIF-rotated JPEG (stored size height×width), palette PNG with a transparent
    index, RGBA PNG, grey PNG. Made quickly (octree palette, light zlib): what is checked is the decoding and
    resizing of these files, not how they were compressed."""
    image, buffer, kind = Image.fromarray(_picture(rng, height, width)), io.BytesIO(), "rgb"
    if index % 5 == 1:
        exif = Image.Exif()
        exif[ORIENTATION] = rng.choice(TURNS)
        image.save(buffer, "JPEG", quality=90, exif=exif.tobytes())
        return buffer.getvalue(), "exif"
    if index % 5 == 2:
        palette = image.quantize(colors=32, method=Image.Quantize.FASTOCTREE)
        palette.save(buffer, "PNG", transparency=rng.randrange(32), compress_level=PNG_LEVEL)
        return buffer.getvalue(), "palette"
    if index % 5 == 3:
        image.putalpha(Image.fromarray(_picture(rng, height, width)[..., 0]))
        kind = "rgba"
    elif index % 5 == 4:
        image, kind = image.convert("L"), "grey"
    image.save(buffer, "PNG", compress_level=PNG_LEVEL)
    return buffer.getvalue(), kind


def _upright_rgb(data: bytes) -> Image.Image:
    """What torchvision is handed: the image upright (EXIF applied), transparency over white, RGB."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")


def _cover_size(tv, image: Image.Image, height: int, width: int) -> int:
    """The smallest ``Resize(size)`` whose output (torchvision's own) covers height×width: a binary search."""
    probe = Image.new("L", image.size)
    low, high = 1, max(height, width)  # high always covers: the short side at max(h, w), the long one no less
    while low < high:
        middle = (low + high) // 2
        out = tv.Resize(middle, tv.InterpolationMode.NEAREST)(probe)  # the size rule is the same for every mode
        low, high = (middle + 1, high) if out.height < height or out.width < width else (low, middle)
    return low


def _reference(tv, image: Image.Image, height: int, width: int) -> tuple[np.ndarray, torch.Tensor]:
    size = height if height == width else _cover_size(tv, image, height, width)
    crop = tv.Compose([tv.Resize(size, tv.InterpolationMode.BICUBIC, antialias=True), tv.CenterCrop((height, width))])
    cropped = crop(image)
    return np.asarray(cropped), tv.Compose([tv.ToTensor(), tv.Normalize(0.5, 0.5)])(cropped)


def test_random_sizes_exif_and_palette_images_are_torchvisions_bit_for_bit(tv):
    rng, old_differs, kinds = random.Random(SEED), 0, set()
    for index in range(SIZES):
        height, width = rng.randint(16, 900), rng.randint(16, 900)
        data, kind = _encoded(rng, index, height, width)
        kinds.add(kind)
        if index % 10 == 9:
            target = OBLONG_TARGETS[index // 10 % len(OBLONG_TARGETS)]
        else:
            side = SQUARE_TARGETS[index % 3 != 0]  # a third at the seed's 512, the rest small (quicker)
            target = (side, side)
        expected_frame, expected_pixels = _reference(tv, _upright_rgb(data), *target)
        pixels, clip = prepare_image(data, *target)  # the default policy: torchvision
        assert np.array_equal(clip.frames[0], expected_frame), (index, kind, height, width, target)
        assert pixels.dtype == torch.float32 and torch.equal(pixels[0, :, 0], expected_pixels), (index, kind, target)
        _, old = prepare_image(data, *target, policy="cover-crop")
        old_differs += not np.array_equal(old.frames[0], expected_frame)
    assert kinds == {"rgb", "exif", "palette", "rgba", "grey"}
    # the test can fail: latentforge's older cover-crop (sides rounded, crop at d // 2) misses on most sizes
    assert old_differs > SIZES // 3, old_differs


def test_640x480_to_512_is_682_columns_as_torchvision_not_683(tv):
    image = Image.fromarray(_picture(random.Random(0), 480, 640))
    assert tv.Resize(512, tv.InterpolationMode.BICUBIC)(image).size == (682, 512)
    assert resized_output_size(480, 640, 512) == (512, 682)  # round(640 * 512 / 480) would be 683
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    pixels, _ = prepare_image(buffer.getvalue(), 512, 512)
    assert torch.equal(pixels[0, :, 0], _reference(tv, image, 512, 512)[1])


def test_the_image_family_and_the_seed_recipe_default_to_torchvision(tmp_path, tv):
    model = make_tiny_image(tmp_path / "model", vae="kl", text="none", seed=0)
    base = {"source": f"folder:{tmp_path}", "family": None, "frames": 1, "height": 64, "width": 64}
    spec = make_spec(config(Path("-"), model, tmp_path / "out", **base))[1]
    assert spec.resize == RESIZE_POLICIES["torchvision"] and spec.preprocess is None
    data, _ = _encoded(random.Random(2), 2, 120, 90)  # a palette PNG with a transparent index
    video = prepare_video(data, spec)  # what the pipeline calls for a sample under this spec
    assert torch.equal(video.pixels[0, :, 0], _reference(tv, _upright_rgb(data), 64, 64)[1])
    older = make_spec(config(Path("-"), model, tmp_path / "out", resize="cover-crop", **base))[1]
    assert older.resize == RESIZE_POLICIES["cover-crop"] and older.fingerprint() != spec.fingerprint()
    seed_values = {"source": base["source"], "family": None, "recipe": "cc12m-wds", "format": "webdataset"}
    seed = make_spec(config(Path("-"), model, tmp_path / "out", **seed_values))
    assert seed[1].resize == RESIZE_POLICIES["torchvision"]


def test_an_image_cache_builds_and_its_card_tells_torchvisions_steps(tmp_path):
    model = make_tiny_image(tmp_path / "model", vae="kl", text="none", seed=0)
    src = write_folder(tmp_path / "photos", sample_images()[:2])
    values = {"source": f"folder:{src}", "family": None, "frames": 1, "height": 32, "width": 32}
    ok, result = run_build(config(Path("-"), model, tmp_path / "out", **values))
    assert ok and result["done"] == 2, result
    card = dataset_card(tmp_path / "out", target=parse_target("hf://datasets/org/images"), license="apache-2.0")
    assert "`CenterCrop((32, 32))`, `ToTensor()`, `Normalize(0.5, 0.5)`" in card and "no crop" not in card


def test_torchvision_is_refused_for_a_video_family(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="--resize torchvision: a policy for still images"):
        make_spec(config(tmp_path, tiny_model, tmp_path / "out", resize="torchvision"))


#: The tiny plugin family of `tests.test_family_plugins` with its own preprocessing: a plain stretch (LANCZOS).
OWN = PLUGIN + textwrap.dedent(
    '''

    import numpy as np
    from PIL import Image


    def stretch_lanczos(image, height, width):
        """Stretch to height x width (Lanczos), [-1, 1]: no crop, unlike every resize policy."""
        resized = np.asarray(image.resize((width, height), Image.Resampling.LANCZOS), dtype=np.uint8).copy()
        return torch.from_numpy(resized).permute(2, 0, 1).float() / 127.5 - 1


    class OwnPreprocessFamily(TinyConvFamily):
        preprocess = stretch_lanczos
    '''
)


def test_a_plugin_familys_own_preprocessing_is_used_and_recorded(tmp_path, monkeypatch):
    (tmp_path / "lf_own_pre.py").write_text(OWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = importlib.import_module("lf_own_pre")
    model = plugin.make_model(tmp_path / "model", seed=0)
    family = "lf_own_pre:OwnPreprocessFamily"
    base = {"source": f"folder:{tmp_path}", "family": family, "frames": 1, "height": 32, "width": 48}
    spec = make_spec(config(Path("-"), model, tmp_path / "out", **base))[1]
    assert spec.preprocess == "lf_own_pre:stretch_lanczos"
    rng = random.Random(1)
    data, _ = _encoded(rng, 1, 90, 70)  # an EXIF-rotated JPEG: the function gets it upright
    video = prepare_video(data, spec)
    expected = plugin.stretch_lanczos(_upright_rgb(data), 32, 48)
    assert torch.equal(video.pixels[0, :, 0], expected)
    assert not torch.equal(video.pixels, prepare_image(data, 32, 48)[0])  # not the resize policy's pixels
    # the spec names the function: a renamed one is another spec, and a spec naming another is refused
    (tmp_path / "lf_own_pre2.py").write_text(OWN.replace("stretch_lanczos", "stretch_lanczos_v2"))
    renamed = make_spec(
        config(Path("-"), model, tmp_path / "out", **{**base, "family": "lf_own_pre2:OwnPreprocessFamily"})
    )
    assert renamed[1].preprocess == "lf_own_pre2:stretch_lanczos_v2"
    assert CacheSpec.model_validate({**spec.model_dump(), "preprocess": "x:y"}).fingerprint() != spec.fingerprint()
    with pytest.raises(ConfigError, match="preprocesses its images itself"):
        make_spec(config(Path("-"), model, tmp_path / "out", resize="torchvision", **base))
    stale = CacheSpec.model_validate({**spec.model_dump(), "preprocess": "lf_own_pre:other"})
    with pytest.raises(ConfigError, match="is not family"):
        prepare_video(data, stale)
