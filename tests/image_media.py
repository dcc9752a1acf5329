"""Real images from scikit-image's data folder in every mode the image family takes, with their captions, and
writers of them as a WebDataset tar and as a folder tree."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import skimage.data
from PIL import Image

#: EXIF orientation 6: the stored pixels are shown rotated 90° clockwise.
EXIF_ORIENTATION, ROTATE_CW = 0x0112, 6


class StillImage(NamedTuple):
    key: str
    data: bytes
    caption: str
    mode: str


def _caption(loader: str) -> str:
    """The first docstring line of scikit-image's loader ("Chelsea the cat.")."""
    return getattr(skimage.data, loader).__doc__.strip().splitlines()[0].strip()


def _encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def small(loader: str, size: int = 96) -> Image.Image:
    """scikit-image's image (no download: the files ship in the wheel), shrunk so tests stay quick."""
    image = Image.fromarray(np.asarray(getattr(skimage.data, loader)()))
    image.thumbnail((size, size), Image.Resampling.LANCZOS)
    return image


def with_alpha(image: Image.Image) -> Image.Image:
    """The image with a left-to-right alpha ramp, fully transparent in its first eighth (logo's own alpha is
    opaque wherever it is coloured)."""
    rgba = np.asarray(image.convert("RGBA")).copy()
    width = rgba.shape[1]
    ramp = np.clip((np.arange(width) - width // 8) * 255 // max(1, width - width // 8), 0, 255).astype(np.uint8)
    rgba[..., 3] = np.minimum(rgba[..., 3], ramp[None, :])
    return Image.fromarray(rgba, "RGBA")


def rotated_jpeg() -> bytes:
    """coffee stored on its side with EXIF orientation 6 (as a phone writes a portrait photo)."""
    stored = small("coffee").transpose(Image.Transpose.ROTATE_90)  # shown upright after a 90° clockwise turn
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = ROTATE_CW
    return _encode(stored, "JPEG", quality=95, exif=exif.tobytes())


def sample_images() -> list[StillImage]:
    """astronaut (RGB), camera (L), logo with an alpha ramp (RGBA), chelsea as a palette with a transparent index
    (P), coffee with an EXIF rotation (JPEG), rocket (WebP)."""
    palette = small("chelsea").convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    palette.info["transparency"] = 0
    return [
        StillImage("astronaut", _encode(small("astronaut"), "PNG"), _caption("astronaut"), "RGB"),
        StillImage("camera", _encode(small("camera"), "PNG"), _caption("camera"), "L"),
        StillImage("logo", _encode(with_alpha(small("logo")), "PNG"), _caption("logo"), "RGBA"),
        StillImage("chelsea", _encode(palette, "PNG", transparency=0), _caption("chelsea"), "P"),
        StillImage("coffee", rotated_jpeg(), _caption("coffee"), "EXIF"),
        StillImage("rocket", _encode(small("rocket"), "WEBP", quality=90), _caption("rocket"), "RGB"),
    ]


def suffix(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return "png"
    return "webp" if data[:4] == b"RIFF" else "jpg"


def write_wds(path: Path, images: list[StillImage], mtime: int = 1_700_000_000) -> Path:
    """A WebDataset tar: ``<key>.<ext>``, ``<key>.txt``, ``<key>.json`` per image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for image in images:
            meta = f'{{"mode": "{image.mode}"}}'.encode()
            for name, data in (
                (f"{image.key}.{suffix(image.data)}", image.data),
                (f"{image.key}.txt", image.caption.encode()),
                (f"{image.key}.json", meta),
            ):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), mtime
                tf.addfile(info, io.BytesIO(data))
    return path


def write_folder(root: Path, images: list[StillImage]) -> Path:
    """A nested tree: ``<mode>/<key>.<ext>`` + ``<mode>/<key>.txt``."""
    for image in images:
        folder = root / image.mode.lower() / "set-1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{image.key}.{suffix(image.data)}").write_bytes(image.data)
        (folder / f"{image.key}.txt").write_text(image.caption, encoding="utf-8")
    return root
