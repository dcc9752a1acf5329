"""Still images as the image family feeds them to its VAE (Pillow; no video decoder involved).

EXIF orientation applied (`ImageOps.exif_transpose`); grayscale, palette, CMYK and 16-bit modes converted to
RGB, transparency (RGBA, LA, a palette with a transparent index) composited over white. Then one of:

* ``torchvision`` (the image family's default): torchvision's PIL path, number for number, as the CC12M seed
  preprocesses (``Resize(size, BICUBIC, antialias=True) → CenterCrop → ToTensor → Normalize(0.5, 0.5)``): the
  short side resized to ``size`` and the long side to ``int(size * long / short)`` (truncated) with Pillow's
  bicubic (antialiased when shrinking), the crop at ``int(round((d - crop) / 2))``, then ``x / 255`` and
  ``(x - 0.5) / 0.5`` in float32. For a square H×W, ``size`` = H: exactly ``Resize(H)`` + ``CenterCrop(H)``.
  For a non-square H×W, ``size`` is the smallest short side whose resize covers H×W (then ``CenterCrop((H, W))``):
  the whole target filled, the aspect kept, as little cut as torchvision's integer sizes allow.
* ``cover-crop`` (latentforge ≤ this change): the scale that covers H×W with both sides rounded, the crop at
  ``d // 2``, ``/127.5 - 1``. Kept so a cache made with it can be extended; it is not torchvision's.
* a family's own ``preprocess`` (`infra.models.base.FamilySpec.preprocess`): the upright RGB image → pixels.

The result is a one-frame `SampledClip`, so every step that handles clips (decode-and-verify, the overfit export)
handles images unchanged.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from infra.errors import InputError
from infra.media.video import DEFAULT_LIMITS, MediaLimits, SampledClip

logger = logging.getLogger(__name__)

#: File name suffixes the image sources take as images.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
#: Leading bytes of the image formats above (``RIFF....WEBP`` is checked in `is_image`).
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")
WHITE = (255, 255, 255)


def is_image(media: bytes) -> bool:
    """True for JPEG, PNG and WebP bytes (by their signature, nothing decoded)."""
    return media.startswith(_MAGIC) or (media[:4] == b"RIFF" and media[8:12] == b"WEBP")


def load_rgb(media: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image upright (EXIF orientation applied) and in RGB, transparency over white (`open_image`'s errors)."""
    image = open_image(media, limits)
    upright = ImageOps.exif_transpose(image)
    return to_rgb(upright if upright is not None else image)


def open_image(media: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image as stored, decoded. InputError ``not_an_image`` for bytes Pillow cannot read, ``too_many_pixels``
    past `limits` (checked from the header, before decoding) or past Pillow's own bomb limit (twice its
    ``MAX_IMAGE_PIXELS``, which it refuses at open: a skip like any other, not an encode error that would fail the
    sanity or stop a shard)."""
    try:
        with warnings.catch_warnings():
            # Pillow warns past its MAX_IMAGE_PIXELS; --max-pixels is the limit here, checked below before decoding.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(media))
            if image.width * image.height > limits.max_pixels:
                raise InputError(
                    "too_many_pixels", f"{image.width}x{image.height} is over --max-pixels {limits.max_pixels}"
                )
            image.load()
    except Image.DecompressionBombError as exc:
        raise InputError("too_many_pixels", f"{exc} (Pillow's own limit; --max-pixels is {limits.max_pixels})") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError("not_an_image", f"{type(exc).__name__}: {exc}") from exc
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with transparency (alpha channel or a palette's transparent index) composited over white."""
    if image.mode == "RGB":
        return image
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif image.mode in ("LA", "La", "PA"):
        image = image.convert("RGBA")
    elif image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        image = image.convert("F").point(lambda v: v / 256).convert("L")  # 16 bits: the top 8
    if image.mode in ("RGBA", "RGBa"):
        background = Image.new("RGBA", image.size, (*WHITE, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def cover_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """Resize (bicubic) so the image covers height×width with its aspect kept, then crop the centre (the
    ``cover-crop`` policy: sides rounded, crop at ``d // 2``)."""
    scale = max(width / image.width, height / image.height)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    resized = image.resize(size, Image.Resampling.BICUBIC) if size != image.size else image
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return resized.crop((left, top, left + width, top + height))


def to_pixels(image: Image.Image) -> torch.Tensor:
    """An RGB image → (1, 3, 1, H, W) float32 in [-1, 1] (the clip layout every family's VAE call takes)."""
    array = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())
    return (array.permute(2, 0, 1).float() / 127.5 - 1.0)[None, :, None]


def short_side_size(image_height: int, image_width: int, height: int, width: int) -> int:
    """The ``size`` of torchvision's ``Resize(size)`` (short side → size, long side → ``int(size * long /
    short)``) that covers height×width with the least resize: height for a square target on any image."""
    short, long = sorted((image_height, image_width))
    want_short, want_long = (width, height) if image_width <= image_height else (height, width)
    size = max(want_short, -(-want_long * short // long))  # ceil: the long side's need, before truncation
    while int(size * long / short) < want_long:  # torchvision's float product, truncated, may fall 1 short
        size += 1
    return size


def resized_output_size(image_height: int, image_width: int, size: int) -> tuple[int, int]:
    """(h, w) of torchvision's ``Resize(size)`` of an image_height×image_width image (its
    ``_compute_resized_output_size`` for one int: the long side truncated)."""
    short, long = (image_width, image_height) if image_width <= image_height else (image_height, image_width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if image_width <= image_height else (new_short, new_long)


def torchvision_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """``Resize(size, BICUBIC, antialias=True)`` on the PIL image (Pillow's resize, as torchvision calls it),
    then ``CenterCrop((height, width))`` (offsets ``int(round((d - crop) / 2.0))``); `short_side_size`'s size."""
    size = short_side_size(image.height, image.width, height, width)
    new_h, new_w = resized_output_size(image.height, image.width, size)
    resized = image.resize((new_w, new_h), Image.Resampling.BICUBIC) if (new_h, new_w) != image.size[::-1] else image
    top, left = round((new_h - height) / 2.0), round((new_w - width) / 2.0)  # int(round(...)): half to even
    return resized.crop((left, top, left + width, top + height))


def torchvision_pixels(image: Image.Image) -> torch.Tensor:
    """An RGB image → (1, 3, 1, H, W) as ``ToTensor()`` then ``Normalize(0.5, 0.5)``: ``x / 255``, ``(x - 0.5) /
    0.5`` in float32, in torchvision's order (for uint8 input it equals `to_pixels`' ``x / 127.5 - 1`` bit for bit;
    the order is kept so the two stay one computation by construction, not by that coincidence)."""
    array = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous()
    return array.float().div(255).sub_(0.5).div_(0.5)[None, :, None]


#: Image resize policies (the names of `infra.media.video.RESIZE_POLICIES` an image family takes): the crop to
#: height×width, and the crop's conversion to pixels.
IMAGE_POLICIES: dict[str, tuple[Callable[[Image.Image, int, int], Image.Image], Callable[[Image.Image], torch.Tensor]]]
IMAGE_POLICIES = {"torchvision": (torchvision_crop, torchvision_pixels), "cover-crop": (cover_crop, to_pixels)}

#: A family's own preprocessing: (upright RGB image, height, width) → (3, height, width) float32 in [-1, 1].
Preprocess = Callable[[Image.Image, int, int], torch.Tensor]


def prepare_image(
    media: bytes,
    height: int,
    width: int,
    limits: MediaLimits = DEFAULT_LIMITS,
    policy: str = "torchvision",
    preprocess: Preprocess | None = None,
) -> tuple[torch.Tensor, SampledClip]:
    """(pixels (1, 3, 1, H, W) in [-1, 1], the one-frame clip they came from) of an image file, by the resize
    `policy` (`IMAGE_POLICIES`) or, where given, the family's own `preprocess` (the clip's frame is then its
    pixels back in uint8, what decode-and-verify compares against)."""
    if not is_image(media):
        raise InputError("not_an_image", "the sample's media is not a JPEG, PNG or WebP image")
    upright = load_rgb(media, limits)
    if preprocess is not None:
        pixels = preprocess(upright, height, width)
        if tuple(pixels.shape) != (3, height, width):
            raise ValueError(f"the family's preprocess made {tuple(pixels.shape)}, not (3, {height}, {width})")
        pixels = pixels.float()[None, :, None]
        frame = ((pixels[0, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()[None]
    else:
        if policy not in IMAGE_POLICIES:
            raise ValueError(f"resize policy {policy!r} is not one for images ({', '.join(IMAGE_POLICIES)})")
        crop, convert = IMAGE_POLICIES[policy]
        cropped = crop(upright, height, width)
        pixels, frame = convert(cropped), np.asarray(cropped, dtype=np.uint8)[None]
    clip = SampledClip(frame, 1, upright.height, upright.width, (0,), fps=1.0)
    return pixels, clip
