"""Prepare, the trip's second stage: a sample's bytes → the recipe's pixels (decoded, temporally sampled, bucketed,
resized), a `PreparedSample`.

The same `prepare_video` serves the preprocess, the one-sample sanity, the dry run and the decode-and-verify
re-derivation of source frames, so every step sees the recipe's exact numbers. The shard's read-ahead
(`infra.preprocess.prefetch`) runs `prepare` on its decoders (`infra.preprocess.decoders`: threads or processes).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from infra.config import CacheSpec
from infra.devices import DTYPES
from infra.errors import ConfigError, InputError
from infra.job import Job
from infra.media.buckets import Bucket, bucket_rule, reference_buckets
from infra.media.image import is_image, load_rgb, prepare_image
from infra.media.masks import audio_mask_signal, video_mask
from infra.media.resize import resize_pixels, resize_policy_of
from infra.media.still import CONSUMER_POLICIES, still_pixels
from infra.media.temporal import TemporalPolicy, choose_windows, effective_fps, vae_aligned_indices
from infra.media.video import (
    DEFAULT_LIMITS,
    MediaLimits,
    PixelTarget,
    SampledClip,
    head_frames,
    pick_frames,
    sample_frames,
)
from infra.models import get_family
from infra.models.base import ROLE_MEDIA, preprocess_name, preprocess_of
from infra.preprocess.read import RawSample
from infra.sources import SampleRef

#: The roles whose bytes go to the audio encoder (`PreparedSample.audio_roles`): every audio file a mode reads but the
#: sample's own (`SampleRef.read_audio`).
AUDIO_ROLES = tuple(role for role, medium in ROLE_MEDIA.items() if medium == "audio" and role != "audio")


@dataclass(frozen=True)
class PreparedVideo:
    """A clip as the recipe feeds it to the VAE: pixels (1, 3, F, H, W) in [-1, 1], the frames picked, and the
    bucket chosen (None without buckets)."""

    pixels: torch.Tensor
    clip: SampledClip
    bucket: Bucket | None


@dataclass(frozen=True)
class PreparedSample:
    """What the encoders take: the prompt, the recipe's pixels, and the media bytes (a clip's own audio track);
    `sampling`: what the sample records of its frames (`sampling_record`)."""

    ref: SampleRef
    prompt: str
    media: bytes
    video: PreparedVideo | None  # None: an audio-only mode's sample (its media is the audio file)
    sampling: dict[str, Any]
    #: An IC-LoRA sample's reference video, prepared as the trainer does (`prepare_reference`).
    reference: PreparedVideo | None = None
    #: An inpainting sample's masks by output kind: ``video_masks`` on the latents' grid (`infra.media.masks`).
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The bytes of the sample's audio roles (``reference_audio``), encoded with its audio.
    audio_roles: dict[str, bytes] = field(default_factory=dict)
    #: An audio-inpainting sample's raw mask signal, resized to its audio latents' steps once they are made.
    audio_mask: torch.Tensor | None = None


def media_limits(job: Job) -> MediaLimits:
    """The job's ``--max-pixels`` and ``--max-frames``."""
    return MediaLimits(max_pixels=job.limits.max_pixels, max_frames=job.limits.max_frames)


@dataclass(frozen=True)
class Decoded:
    """What decoding makes of a sample's media, without its source-resolution frames: its video's pixels (None in an
    audio-only mode), an IC-LoRA reference's, inpainting masks by output kind, an audio mask's raw signal."""

    video: PreparedVideo | None
    reference: PreparedVideo | None = None
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    audio_mask: torch.Tensor | None = None


def decode_media(media: bytes, roles: dict[str, bytes], window: int | None, job: Job) -> Decoded:
    """A sample's media (and its mode's other roles: a reference video, masks) decoded under `job`: the same code
    on a decoder thread, in a decoder process (which takes the job once) and for the sanity. InputError for bad
    input."""
    if not job.video:  # an audio-only mode: no video to prepare; the audio itself is decoded by its encoder
        return Decoded(None, audio_mask=audio_mask_signal(roles["audio_mask"]) if "audio_mask" in roles else None)
    limits = media_limits(job)
    video = _without_frames(prepare_video(media, job.spec, window, limits))
    reference = None
    if "reference_video" in roles:
        reference = _without_frames(prepare_reference(roles["reference_video"], job.spec, limits))
    masks = {}
    if "video_mask" in roles and job.mask_multiples is not None:
        time, spatial = job.mask_multiples
        frames, height, width = video.pixels.shape[2:]
        grid = ((frames - 1) // time + 1, height // spatial, width // spatial)
        masks["video_masks"] = video_mask(roles["video_mask"], grid, spatial, time, limits)
    return Decoded(video, reference, masks)


def prepare(raw: RawSample, job: Job) -> PreparedSample:
    """The sample's pixels under the job, without the source-resolution frames (the encoder needs the pixels; a
    sample waiting in the read-ahead's queue holds only them): the same on a decoder thread, in a decoder process
    and for the sanity."""
    return prepared_sample(raw, decode_media(raw.media, raw.roles, raw.ref.window, job))


def prepared_sample(raw: RawSample, decoded: Decoded) -> PreparedSample:
    """The sample `raw` with what decoding made of it; its audio roles' bytes go along as read (the encoder decodes
    them)."""
    audio_roles = {role: data for role, data in raw.roles.items() if role in AUDIO_ROLES}
    video = decoded.video
    record = sampling_record(video.clip) if video is not None else {}
    return PreparedSample(
        raw.ref, raw.prompt, raw.media, video, record, decoded.reference, decoded.masks, audio_roles, decoded.audio_mask
    )


def _without_frames(video: PreparedVideo) -> PreparedVideo:
    """`video` without its source-resolution frames (the encoder needs the pixels only; contiguous, so a decoder
    process sends them in one shared-memory block)."""
    clip = dataclasses.replace(video.clip, frames=video.clip.frames[:0].copy())
    return dataclasses.replace(video, pixels=video.pixels.contiguous(), clip=clip)


def reference_spec(spec: CacheSpec) -> CacheSpec:
    """`spec` with the reference video's geometry: the buckets (or the fixed height and width) divided by
    ``reference_downscale_factor``, as the trainer's ``compute_scaled_resolution_buckets``."""
    factor = spec.reference_downscale_factor
    if factor == 1:
        return spec
    buckets = [Bucket(*b) for b in spec.buckets] if spec.buckets else None
    scaled = [tuple(b) for b in reference_buckets(buckets, factor)] if buckets else None
    return spec.model_copy(update={"buckets": scaled, "height": spec.height // factor, "width": spec.width // factor})


def prepare_reference(media: bytes, spec: CacheSpec, limits: MediaLimits = DEFAULT_LIMITS) -> PreparedVideo:
    """An IC-LoRA sample's reference video as the LTX-2 trainer prepares it: its own bucket among the sample's
    buckets scaled by ``reference_downscale_factor`` (chosen by the reference's own shape and frames), resized as a
    clip, then frame 0 and every ``reference_temporal_scale_factor``-th frame from frame 1 on. Its InputErrors are
    the clip's, named ``reference_<reason>``."""
    try:
        video = prepare_video(media, reference_spec(spec), None, limits)
    except InputError as exc:
        raise InputError(f"reference_{exc.reason}", f"the reference video: {exc.detail}") from exc
    keep = vae_aligned_indices(video.pixels.shape[2], spec.reference_temporal_scale_factor)
    if len(keep) == video.pixels.shape[2]:
        return video
    clip = dataclasses.replace(video.clip, indices=tuple(video.clip.indices[i] for i in keep))
    return PreparedVideo(video.pixels[:, :, keep].contiguous(), clip, video.bucket)


def prepare_video(
    media: bytes, spec: CacheSpec, window: int | None = None, limits: MediaLimits = DEFAULT_LIMITS
) -> PreparedVideo:
    """The recipe's pixels of one clip under `spec`: frames by its temporal policy (`infra.media.temporal`; for
    ``windows:K`` the window starting at source frame `window`), the bucket by the LTX-2 trainer's rule, resized
    by its resize policy. InputError for bad input, a clip over `limits` (refused before decoding) or a clip too
    short for a policy that skips short clips. A spec of an image family takes a still image instead
    (`infra.media.image`: one frame; a video is refused, ``not_an_image``); under ``head`` (the LTX-2 trainer's)
    a png/jpg among clips is a one-frame clip at fps 1.0, as the trainer takes it."""
    family = get_family(spec.family)
    if family.media == "image":
        if spec.preprocess != preprocess_name(family):  # the code that would run is not the one the spec names
            raise ConfigError(f"the spec's preprocess {spec.preprocess} is not family {family.name}'s now")
        own = preprocess_of(family)
        if (resize := resize_policy_of(spec.resize)) in CONSUMER_POLICIES:  # the consumer's loader, bucket, resize
            buckets = [Bucket(*b) for b in spec.buckets] if spec.buckets else None
            pixels, still, bucket = still_pixels(
                media, resize, spec.height, spec.width, buckets=buckets, layout=spec.layout,
                upright=spec.rotate == "auto", dtype=DTYPES[spec.dtype], limits=limits,
            )  # fmt: skip
            return PreparedVideo(pixels, still, bucket)
        pixels, still = prepare_image(media, spec.height, spec.width, limits, resize, own)
        return PreparedVideo(pixels, still, None)
    policy = TemporalPolicy.of(spec)
    buckets = [Bucket(*b) for b in spec.buckets] if spec.buckets else None
    frames, height, width, bucket = spec.frames, spec.height, spec.width, None
    resize = resize_policy_of(spec.resize)
    upright = spec.rotate == "auto"  # turned by the display matrix (the consumer's reader does, or --rotate auto)
    dtype = DTYPES[spec.dtype]  # a consumer scaling its pixels in its VAE's dtype does it in the run's
    if policy.kind == "head":
        if is_image(media):  # a still in a video set: one frame at fps 1.0, as the LTX-2 trainer takes png/jpg
            clip = _still(media, limits)
        else:
            count = max(b.frames for b in buckets) if buckets else spec.frames
            clip = head_frames(media, count, limits=limits, upright=upright)
        if buckets:
            choose = bucket_rule(spec.layout)  # the rule its consumer recomputes the bucket with
            bucket = choose(buckets, len(clip.frames), clip.source_height, clip.source_width)
            frames, height, width = bucket.frames, bucket.height, bucket.width
        if len(clip.frames) < frames and (buckets or policy.short == "skip"):
            raise InputError("clip_too_short", f"the clip decodes to {len(clip.frames)} frame(s); {frames} needed")
        clip = _held(clip, frames)
        return PreparedVideo(resize_pixels(clip.frames[:frames], height, width, resize, dtype=dtype), clip, bucket)
    if policy.kind == "span":  # the pixels are made as the frames are decoded: no clip of source frames is held
        target = PixelTarget(height, width, resize, dtype)
        clip = sample_frames(media, spec.frames, limits=limits, target=target, upright=upright)
        if clip.source_frames < frames and policy.short == "skip":
            raise InputError("clip_too_short", f"the clip has {clip.source_frames} frame(s); span needs {frames}")
    else:
        choose = functools.partial(_indices, policy, frames, window)
        target = PixelTarget(height, width, resize, dtype)
        clip = pick_frames(media, choose, limits=limits, target=target, upright=upright)
    return PreparedVideo(clip.pixels[:, :, :frames], dataclasses.replace(clip, pixels=None), bucket)  # held once


def _still(media: bytes, limits: MediaLimits) -> SampledClip:
    """An image as a one-frame clip at fps 1.0 (upright, RGB over white: `infra.media.image.load_rgb`), to be
    bucketed and resized as a clip's frames are: a bucket of one frame, or ``--frames 1``."""
    upright = load_rgb(media, limits)
    frame = np.array(upright, dtype=np.uint8)[None]  # a writable copy: torch takes it without a warning
    return SampledClip(frame, 1, upright.height, upright.width, (0,), fps=1.0)


def _indices(policy: TemporalPolicy, frames: int, window: int | None, total: int, fps: float) -> tuple[int, ...]:
    windows = choose_windows(policy, total, fps, frames)
    if policy.kind != "windows":
        return windows[0].indices
    if window is None:
        return windows[0].indices  # the one-sample steps (sanity, dry run) look at a clip's first window
    for w in windows:
        if w.first == window:
            return w.indices
    raise InputError("window_gone", f"the clip ({total} frames) has no window starting at frame {window} now")


def _held(clip: SampledClip, frames: int) -> SampledClip:
    """A head clip with fewer than `frames` frames, its last frame repeated (--short-clips repeat)."""
    missing = frames - len(clip.frames)
    if missing <= 0:
        return clip
    held = np.concatenate([clip.frames, np.repeat(clip.frames[-1:], missing, axis=0)])
    indices = clip.indices + (clip.indices[-1],) * missing
    return dataclasses.replace(clip, frames=held, indices=indices)


def sampling_record(clip: SampledClip) -> dict[str, Any]:
    """What a sample records of its frames: the source's fps, the fps they play at and the source indices, and
    the display-matrix rotation (degrees counter-clockwise) of a rotated clip (its frames as stored, or upright under
    ``--rotate auto``: the spec says which)."""
    record: dict[str, Any] = {
        "source_fps": round(clip.fps, 6),
        "fps": round(effective_fps(clip.indices, clip.fps), 6),
        "indices": list(clip.indices),
    }
    if clip.rotation:
        record["rotation"] = clip.rotation
    return record
