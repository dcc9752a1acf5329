"""Resolution buckets: ``WxHxF;WxHxF`` (an image bucket is ``WxHx1``), and the LTX-2 trainer's choice of one per
clip: among buckets with F ≤ the clip's decoded frames, the smallest |log aspect-ratio difference|, then the most
frames, then the largest area. A clip shorter than every bucket is skipped with its frame count. musubi-tuner's
buckets and its own choice (the smallest |aspect-ratio difference|, the first in order) are here too."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from infra.bounds import bucket_sizes
from infra.errors import ConfigError, InputError


class Bucket(NamedTuple):
    """One bucket: width, height, frames."""

    width: int
    height: int
    frames: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


def parse_buckets(text: str) -> list[Bucket]:
    """``"768x512x49;512x512x49"`` → buckets, in the given order; ConfigError names the bad part (the grammar and
    its bounds: `infra.bounds.bucket_sizes`, which the config checks too)."""
    return [Bucket(*size) for size in bucket_sizes(text)]


def choose_bucket(buckets: list[Bucket], frames: int, height: int, width: int) -> Bucket:
    """The trainer's bucket for a clip of `frames` decoded frames of `width`×`height`; InputError
    ``too_short_for_buckets`` (with the frame count and the fewest frames a bucket needs) when none fits."""
    fitting = [b for b in buckets if b.frames <= frames]
    if not fitting:
        shortest = min(buckets, key=lambda b: b.frames)
        raise InputError(
            "too_short_for_buckets",
            f"the clip decodes to {frames} frame(s); the shortest bucket, {shortest}, needs {shortest.frames}",
        )
    ratio = math.log(width / height)

    def key(b: Bucket) -> tuple[float, int, int]:
        return abs(ratio - math.log(b.width / b.height)), -b.frames, -(b.width * b.height)

    return min(fitting, key=key)


#: musubi-tuner's bucket step for Wan (``BucketSelector.RESOLUTION_STEPS_WAN``).
MUSUBI_STEP = 16


def musubi_buckets(width: int, height: int, frames: int) -> list[Bucket]:
    """musubi-tuner's buckets for a dataset's ``resolution`` (``BucketSelector(resolution, enable_bucket=True)``, its
    ``dataset/bucket.py`` at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7), each of `frames`: widths in steps of
    16 from half the side of the resolution's square up to that side, each with the height (a multiple of 16) that
    keeps the area at most the resolution's, both ways round, sorted."""
    area = width * height
    side = int(math.sqrt(area))
    found: set[tuple[int, int]] = set()
    for w in range(side // 2 - side // 2 % MUSUBI_STEP, side + MUSUBI_STEP, MUSUBI_STEP):
        h = area // w - area // w % MUSUBI_STEP
        found |= {(w, h), (h, w)}
    return [Bucket(w, h, frames) for w, h in sorted(found)]


def choose_musubi_bucket(buckets: list[Bucket], frames: int, height: int, width: int) -> Bucket:
    """musubi-tuner's bucket for a clip of `width`×`height` (``get_bucket_resolution``: the first of the buckets, in
    their order, with the smallest |w/h - width/height|, without ``bucket_no_upscale``), among those with F ≤ its
    `frames` (its ``head`` extraction makes no sample of a shorter clip: InputError ``too_short_for_buckets``)."""
    fitting = [b for b in buckets if b.frames <= frames]
    if not fitting:
        return choose_bucket(buckets, frames, height, width)  # the same refusal, with the same reason
    ratio = width / height
    return min(fitting, key=lambda b: abs(b.width / b.height - ratio))


#: A layout's own bucket rule (`infra.formats.consumers`): the one its consumer recomputes at training time.
BUCKET_RULES = {"musubi": choose_musubi_bucket}


def bucket_rule(layout: str | None) -> Callable[[list[Bucket], int, int, int], Bucket]:
    """The rule that picks a clip's bucket under the spec's `layout` (default: the LTX-2 trainer's)."""
    return BUCKET_RULES.get(layout or "", choose_bucket)


def reference_buckets(buckets: list[Bucket], downscale: int) -> list[Bucket]:
    """The LTX-2 trainer's buckets of an IC-LoRA sample's reference video: each bucket's width and height divided by
    `downscale`, its frames kept (the reference is read at the bucket's frames, then subsampled in time)."""
    return [Bucket(b.width // downscale, b.height // downscale, b.frames) for b in buckets]


def check_reference_buckets(buckets: list[Bucket], downscale: int, temporal: int, spatial: int, time: int) -> None:
    """ConfigError, as the trainer's ``process_dataset.py`` refuses them: a factor > 1 with more than one bucket, a
    size the downscale factor does not divide or leaves off the VAE's `spatial` multiple, a frame count whose
    subsampled count (frame 0, then every `temporal`-th) is not ``1 mod time``."""
    for flag, factor in (("--reference-downscale-factor", downscale), ("--reference-temporal-scale-factor", temporal)):
        if factor > 1 and len(buckets) > 1:
            raise ConfigError(
                f"{flag} {factor}: with a factor > 1 the LTX-2 trainer supports a single resolution bucket only "
                f"({len(buckets)} given: {';'.join(map(str, buckets))})"
            )
    for bucket in buckets:
        for name, size in (("height", bucket.height), ("width", bucket.width)):
            if size % downscale:
                raise ConfigError(f"--reference-downscale-factor {downscale} does not divide the {name} {size}")
            if (size // downscale) % spatial:
                raise ConfigError(
                    f"--reference-downscale-factor {downscale}: the reference {name} {size // downscale} (from "
                    f"{size}) is not a multiple of {spatial}"
                )
        if (bucket.frames - 1) % temporal:
            raise ConfigError(
                f"--reference-temporal-scale-factor {temporal}: {bucket.frames} frames do not subsample evenly "
                f"(frames - 1 must be divisible by {temporal})"
            )
        kept = 1 + (bucket.frames - 1) // temporal
        if (kept - 1) % time:
            raise ConfigError(
                f"--reference-temporal-scale-factor {temporal}: {bucket.frames} frames subsample to {kept}, "
                f"not {time}·k + 1 as the VAE needs"
            )
