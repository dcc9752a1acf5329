"""Still images as the image family feeds them to its VAE (Pillow; no video decoder involved).

EXIF orientation applied (`ImageOps.exif_transpose`); grayscale, palette, CMYK and 16-bit modes converted to
RGB, transparency (RGBA, LA, a palette with a transparent index) composited over white; the short side resized
to cover H×W (Pillow bicubic, which widens its kernel when shrinking: antialiased) with the size rounded, then
the centre H×W crop; ``/127.5 - 1`` to [-1, 1]. The result is a one-frame `SampledClip`, so every step that
handles clips (decode-and-verify, the overfit export) handles images unchanged.
"""

from __future__ import annotations

import io
import logging
import warnings

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
    """The image upright (EXIF orientation applied) and in RGB, transparency over white. InputError
    ``not_an_image`` for bytes Pillow cannot read, ``too_many_pixels`` past `limits` (checked before decoding)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(media))
            if image.width * image.height > limits.max_pixels:
                raise InputError(
                    "too_many_pixels", f"{image.width}x{image.height} is over --max-pixels {limits.max_pixels}"
                )
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
        raise InputError("not_an_image", f"{type(exc).__name__}: {exc}") from exc
    upright = ImageOps.exif_transpose(image)
    return to_rgb(upright if upright is not None else image)


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
    """Resize (bicubic) so the image covers height×width with its aspect kept, then crop the centre."""
    scale = max(width / image.width, height / image.height)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    resized = image.resize(size, Image.Resampling.BICUBIC) if size != image.size else image
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return resized.crop((left, top, left + width, top + height))


def to_pixels(image: Image.Image) -> torch.Tensor:
    """An RGB image → (1, 3, 1, H, W) float32 in [-1, 1] (the clip layout every family's VAE call takes)."""
    array = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())
    return (array.permute(2, 0, 1).float() / 127.5 - 1.0)[None, :, None]


def prepare_image(
    media: bytes, height: int, width: int, limits: MediaLimits = DEFAULT_LIMITS
) -> tuple[torch.Tensor, SampledClip]:
    """(pixels (1, 3, 1, H, W) in [-1, 1], the one-frame clip they came from) of an image file."""
    if not is_image(media):
        raise InputError("not_an_image", "the sample's media is not a JPEG, PNG or WebP image")
    upright = load_rgb(media, limits)
    cropped = cover_crop(upright, height, width)
    frame = np.asarray(cropped, dtype=np.uint8)[None]
    clip = SampledClip(frame, 1, upright.height, upright.width, (0,), fps=1.0)
    return to_pixels(cropped), clip
