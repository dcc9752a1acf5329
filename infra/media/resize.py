"""Resize policies: decoded frames → the pixels a consumer's own preprocessing would feed its VAE, one named policy per
consumer, each that consumer's arithmetic (cover size and its rounding, crop offsets and their rounding, the kernel
per direction, the value scaling). A format declares its consumer's policy (`infra.formats.consumers`), a user's
``--resize`` overrides it; the CacheSpec records the policy's ``spec_value``.

* ``stretch`` (the seed recipe, ``pt``): ``x / 127.5 - 1``, bilinear to H×W, ``align_corners=False`` (torch).
* ``cover-crop`` (the LTX-2 trainer, ``ltx``): ``x / 255``, bicubic with antialias so the frame covers H×W, the other
  side truncated, centre crop at ``d // 2``, clamp to [0, 1], ``(x - 0.5) / 0.5``.
* ``cover-crop-aa``: as ``cover-crop`` with bilinear (the fastvideo-ltx2 recipe's).
* ``musubi`` (kohya-ss/musubi-tuner, ``musubi``; its ``dataset/media_utils.py`` ``resize_image_to_bucket`` at commit
  30c658c4f4b0bf05038b3346eff9670259b10fc7): a frame already the bucket's size as it is; else the cover size
  ``int(side * scale + 0.5)`` (half up), Pillow's LANCZOS when ``scale > 1``, OpenCV's ``INTER_AREA`` otherwise,
  crop at ``d // 2``; then ``x / 127.5 - 1`` in its VAE's dtype (its ``wan_cache_latents.py``: the run's ``--dtype``).
* ``diffsynth`` (DiffSynth-Studio, ``diffsynth``; the ``diffsynth`` 2.1.12 package's ``ImageCropAndResize``):
  ``round(side * scale)`` (Python's round), torchvision's ``resize`` of the PIL image (Pillow's BILINEAR), its
  ``center_crop`` at ``int(round((d - crop) / 2))``; then ``x * (2 / 255) - 1`` in its pipeline's dtype (its
  ``preprocess_image``: the run's ``--dtype``).
* ``h3-lanczos`` (FastVideo's MiniMax-H3 preprocessing, ``parquet`` of the h3 family; the ``fastvideo`` 0.2.1
  package's ``prepare_reference_frames``): each uint8 frame stretched to H×W by Pillow's LANCZOS (none where it is
  that size already: its aspect is kept only by the canvas the user picks), then ``x / 127.5 - 1`` in float32 (the
  h3 family takes the uint8 values back exactly and scales them as its VAE wants: ``u / 255``, ImageNet).
* ``torchvision`` (still images only: `infra.media.image`).

Two kinds of policy: a float policy converts a chunk of frames as float32 in one torch call (`FloatPolicy`); a frame
policy resizes each uint8 frame with the consumer's own image library, then scales the values (`FramePolicy`). Both
give, per frame, the same numbers however the frames are chunked.
"""

from __future__ import annotations

import functools
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from infra.errors import ConfigError

#: Frames turned into float pixels at once: the float32 copy of a chunk (4 frames of 1080p: ~100 MB) is all that
#: exists at source resolution beside the uint8 frames, so the peak does not grow with the clip's length. Each
#: frame's numbers are computed exactly as in one whole-tensor call (per-frame arithmetic, same memory layout).
PIXEL_CHUNK = 4


class ResizePolicy(ABC):
    """One consumer's frames → pixels: ``(t, H, W, 3)`` uint8 → ``(t, 3, height, width)`` float32 in [-1, 1]."""

    #: The name ``--resize`` takes, and the value the CacheSpec records (its fingerprint hashes it).
    name: str
    spec_value: str
    #: (module, the pip requirement that brings it) the policy imports when it runs, beyond torch and Pillow.
    needs: tuple[str, str] | None = None

    def scratch(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A buffer `convert` may reuse between chunks of frames of `shape` (None: it needs none)."""
        return None

    @abstractmethod
    def convert(
        self,
        frames: np.ndarray,
        height: int,
        width: int,
        scratch: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``frames`` (t, H, W, 3) uint8 → (t, 3, height, width) float32; `dtype`: the run's compute dtype, where the
        consumer scales its pixels in its VAE's dtype (the values are that dtype's, held in float32)."""


class FloatPolicy(ResizePolicy):
    """A policy computed on float32 frames by torch: the chunk's frames copied into one reused float buffer (a new
    source-resolution float tensor per chunk is fresh memory the kernel must fault in again each time), then
    `chunk_fn` (float frames (t, H, W, 3), changed in place as it likes → (t, 3, h, w))."""

    def __init__(self, name: str, spec_value: str, chunk_fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
        self.name, self.spec_value, self.chunk_fn = name, spec_value, chunk_fn

    def scratch(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32)

    def convert(
        self,
        frames: np.ndarray,
        height: int,
        width: int,
        scratch: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        x = (scratch if scratch is not None else self.scratch(frames.shape))[: frames.shape[0]]
        source = frames if frames.flags.writeable else frames.copy()  # torch takes no read-only array (a PIL view)
        x.copy_(torch.from_numpy(source))  # uint8 → float32 is exact: the values of `.float()`
        return self.chunk_fn(x, height, width)


class FramePolicy(ResizePolicy):
    """A policy of a consumer that resizes each uint8 frame with an image library (`resize_frame`: (H, W, 3) →
    (height, width, 3) uint8), then scales the values as it does, in the dtype it does it in (`scale`: (t, height,
    width, 3) uint8 tensor, dtype → that dtype), held in float32 (exact: a cast back loses nothing)."""

    def __init__(
        self,
        name: str,
        spec_value: str,
        resize_frame: Callable[[np.ndarray, int, int], np.ndarray],
        scale: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
        needs: tuple[str, str] | None = None,
    ) -> None:
        self.name, self.spec_value, self.resize_frame, self.scale = name, spec_value, resize_frame, scale
        self.needs = needs

    def convert(
        self,
        frames: np.ndarray,
        height: int,
        width: int,
        scratch: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        resized = np.stack([self.resize_frame(np.ascontiguousarray(f), height, width) for f in frames])
        if resized.shape[1:3] != (height, width):
            raise ValueError(f"policy {self.name} made {resized.shape[2]}x{resized.shape[1]}, not {width}x{height}")
        return self.scale(torch.from_numpy(resized), dtype).float().permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------------------------- float policies


def _stretch_chunk(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    x.div_(127.5).sub_(1.0)  # in place: the same arithmetic as x / 127.5 - 1.0
    x = x.permute(0, 3, 1, 2)  # (T, C, H, W), channels-last in memory as the whole-tensor path has it
    return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)


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


# ----------------------------------------------------------------------------------------------- frame policies


@functools.cache
def _cv2():
    """OpenCV, imported when a musubi frame is first shrunk (its INTER_AREA is not restated: OpenCV's own runs)."""
    import cv2  # noqa: PLC0415 - heavy, and only the musubi policy needs it

    cv2.setNumThreads(1)  # frames are resized in parallel by the decoders, one OpenCV thread each
    return cv2


def musubi_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """musubi-tuner's ``resize_image_to_bucket(frame, (width, height))``, line for line."""
    image_height, image_width = frame.shape[:2]
    if (width, height) == (image_width, image_height):
        return frame
    scale = max(width / image_width, height / image_height)
    image_width, image_height = int(image_width * scale + 0.5), int(image_height * scale + 0.5)
    if scale > 1:
        resized = np.array(Image.fromarray(frame).resize((image_width, image_height), Image.Resampling.LANCZOS))
    else:
        resized = _cv2().resize(frame, (image_width, image_height), interpolation=_cv2().INTER_AREA)
    left, top = (image_width - width) // 2, (image_height - height) // 2
    return resized[top : top + height, left : left + width]


def diffsynth_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """DiffSynth-Studio's ``ImageCropAndResize.crop_and_resize`` of the frame as a PIL image: torchvision's
    ``resize`` (on a PIL image: Pillow's BILINEAR) to ``(round(h * scale), round(w * scale))``, then its
    ``center_crop`` (offsets ``int(round((d - crop) / 2.0))``)."""
    image = Image.fromarray(frame)
    image_width, image_height = image.size
    scale = max(width / image_width, height / image_height)
    new_h, new_w = round(image_height * scale), round(image_width * scale)
    image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top, left = round((new_h - height) / 2.0), round((new_w - width) / 2.0)  # int(round(...)): half to even
    return np.asarray(image.crop((left, top, left + width, top + height)))


def lanczos_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """FastVideo's ``prepare_reference_frames`` of one frame: as it is at H×W, else Pillow's LANCZOS stretch."""
    if frame.shape[:2] == (height, width):
        return frame
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.LANCZOS))


def _exact_half_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.float() / 127.5 - 1.0  # float32 whatever the run's dtype: the uint8 values are recovered exactly


def _half_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) / 127.5 - 1.0  # its wan_cache_latents: contents.to(vae.dtype), then / 127.5 - 1.0


def _diffsynth_scale(x: torch.Tensor, dtype: torch.dtype, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    return x.to(dtype) * ((high - low) / 255) + low  # its preprocess_image: in the pipeline's torch_dtype, its order


POLICIES: dict[str, ResizePolicy] = {
    p.name: p
    for p in (
        # _stretch_chunk looked up when called (a test wraps it)
        FloatPolicy("stretch", "bilinear-align_corners_false", lambda x, h, w: _stretch_chunk(x, h, w)),
        FloatPolicy(
            "cover-crop", "bicubic-antialias-cover-center-crop", lambda x, h, w: _cover_chunk(x, h, w, "bicubic")
        ),
        FloatPolicy(
            "cover-crop-aa", "bilinear-antialias-cover-center-crop", lambda x, h, w: _cover_chunk(x, h, w, "bilinear")
        ),
        FramePolicy(
            "musubi",
            "musubi-round-half-up-cover-lanczos-up-inter_area-down-floor-crop",
            musubi_frame,
            _half_scale,
            needs=("cv2", "opencv-python-headless"),
        ),
        FramePolicy(
            "diffsynth", "diffsynth-round-cover-pil-bilinear-round-crop-2_255", diffsynth_frame, _diffsynth_scale
        ),
        FramePolicy("h3-lanczos", "fastvideo-h3-pil-lanczos-stretch-uint8", lanczos_frame, _exact_half_scale),
        FramePolicy(
            "diffsynth-h3", "diffsynth-round-cover-pil-bilinear-round-crop-uint8", diffsynth_frame, _exact_half_scale
        ),
    )
}

#: Resize policies: the name a user gives → the value the CacheSpec records (stretch keeps latentforge 0.1's).
RESIZE_POLICIES: dict[str, str] = {
    **{name: p.spec_value for name, p in POLICIES.items()},
    # images only (`infra.media.image`): torchvision's Resize(BICUBIC) + CenterCrop on a PIL image
    "torchvision": "torchvision-pil-bicubic-short-side-center-crop",
}
#: Policies for still images only (Pillow, `infra.media.image.IMAGE_POLICIES`): no video family takes them.
IMAGE_ONLY_POLICIES = frozenset({"torchvision"})


def resize_policy_of(spec_value: str) -> str:
    """The policy name of a CacheSpec's ``resize`` value."""
    return next((name for name, value in RESIZE_POLICIES.items() if value == spec_value), spec_value)


def policy(name: str) -> ResizePolicy:
    """The video policy called `name`; ValueError for another."""
    if name not in POLICIES:
        raise ValueError(f"unknown resize policy {name!r}")
    return POLICIES[name]


def require(name: str) -> None:
    """ConfigError, before anything runs, for a policy this install cannot run (its consumer's image library
    missing); nothing for a policy that needs none (or an image policy)."""
    found = POLICIES.get(name)
    if found is not None and found.needs is not None and importlib.util.find_spec(found.needs[0]) is None:
        raise ConfigError(
            f"--resize {name}: its consumer's arithmetic runs {found.needs[1]}'s own code, not installed here: "
            "pip install 'latentforge[wan]'"
        )


def resize_pixels(
    frames: np.ndarray,
    height: int,
    width: int,
    name: str,
    *,
    chunk: int = PIXEL_CHUNK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(F, H, W, 3) uint8 → (1, 3, F, height, width) float32 by the policy called `name`, `chunk` frames at a time
    (each frame's numbers as in one call over all frames), each chunk's result copied into one preallocated output;
    `dtype`: the run's compute dtype (`ResizePolicy.convert`)."""
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    chosen = policy(name)
    out = torch.empty((1, 3, frames.shape[0], height, width), dtype=torch.float32)
    scratch = chosen.scratch((min(chunk, frames.shape[0]), *frames.shape[1:]))
    for first in range(0, frames.shape[0], chunk):
        part = chosen.convert(frames[first : first + chunk], height, width, scratch, dtype)
        out[0, :, first : first + part.shape[0]] = part.permute(1, 0, 2, 3)
    return out


def frames_to_pixels(frames: np.ndarray, height: int, width: int, *, chunk: int = PIXEL_CHUNK) -> torch.Tensor:
    """(F,H,W,3) uint8 → (1,3,F,height,width) float32 in [-1, 1]: /127.5-1, bilinear, align_corners=False (the
    ``stretch`` policy); `chunk` frames at a time (bit-identical to one call over all frames)."""
    return resize_pixels(frames, height, width, "stretch", chunk=chunk)


def cover_crop_pixels(
    frames: np.ndarray, height: int, width: int, mode: str = "bicubic", *, chunk: int = PIXEL_CHUNK
) -> torch.Tensor:
    """(F,H,W,3) uint8 → (1,3,F,height,width) float32 in [-1, 1], as the LTX-2 trainer prepares a clip (the
    ``cover-crop`` policy; ``mode="bilinear"``: ``cover-crop-aa``)."""
    return resize_pixels(frames, height, width, "cover-crop" if mode == "bicubic" else "cover-crop-aa", chunk=chunk)
