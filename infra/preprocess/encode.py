"""Encode one sample: prompt → video → frames → pixels → the family's encoders → an EncodedSample.

The same function serves the preprocess, the one-sample sanity, the dry run and the decode-and-verify
re-derivation of source frames, so every step sees the recipe's exact numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infra.config import BuildConfig, CacheSpec
from infra.devices import resolve_device, resolve_dtype
from infra.errors import InputError, ModelLoadError
from infra.faults import fault_point
from infra.formats import AUDIO_KIND, EncodedSample, textpad
from infra.formats.base import STORE_DTYPES
from infra.formats.consumers import latent_encoder
from infra.media.buckets import Bucket, choose_bucket
from infra.media.image import prepare_image
from infra.media.prompts import decode_prompt
from infra.media.temporal import TemporalPolicy, choose_windows, effective_fps
from infra.media.video import (
    DEFAULT_LIMITS,
    MediaLimits,
    PixelTarget,
    SampledClip,
    head_frames,
    pick_frames,
    resize_pixels,
    resize_policy_of,
    sample_frames,
)
from infra.models import LoadedFamily, get_family, load_family, memory
from infra.models.base import TextEmbedding
from infra.models.memory import LoadOptions
from infra.plan import BuildPlan
from infra.preprocess import ahead, prefetch, texts, videos
from infra.sources import SampleRef


def load_encoder(plan: BuildPlan) -> LoadedFamily:
    """The plan's family, loaded once per process on the configured device."""
    cfg = plan.config
    try:
        device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
        return load_family(Path(cfg.model).expanduser(), plan.family, device, dtype, load_options(cfg))
    except Exception as exc:
        raise ModelLoadError(f"cannot load {plan.family} from {cfg.model}: {type(exc).__name__}: {exc}") from exc


def load_options(cfg: BuildConfig) -> LoadOptions:
    """The memory options a build loads its family with (the decode step reuses that same loaded family)."""
    return LoadOptions(cfg.vae_tiling, cfg.vae_slicing, cfg.text_quantize, cfg.text_offload)


@dataclass(frozen=True)
class PreparedVideo:
    """A clip as the recipe feeds it to the VAE: pixels (1, 3, F, H, W) in [-1, 1], the frames picked, and the
    bucket chosen (None without buckets)."""

    pixels: torch.Tensor
    clip: SampledClip
    bucket: Bucket | None


def media_limits(plan: BuildPlan) -> MediaLimits:
    """The plan's ``--max-pixels`` and ``--max-frames``."""
    return MediaLimits(max_pixels=plan.config.max_pixels, max_frames=plan.config.max_frames)


def prepare_video(
    media: bytes, spec: CacheSpec, window: int | None = None, limits: MediaLimits = DEFAULT_LIMITS
) -> PreparedVideo:
    """The recipe's pixels of one clip under `spec`: frames by its temporal policy (`infra.media.temporal`; for
    ``windows:K`` the window starting at source frame `window`), the bucket by the LTX-2 trainer's rule, resized
    by its resize policy. InputError for bad input, a clip over `limits` (refused before decoding) or a clip too
    short for a policy that skips short clips. A spec of an image family takes a still image instead
    (`infra.media.image`: one frame; a video is refused, ``not_an_image``)."""
    if get_family(spec.family).media == "image":
        pixels, still = prepare_image(media, spec.height, spec.width, limits)
        return PreparedVideo(pixels, still, None)
    policy = spec.temporal_policy()
    buckets = [Bucket(*b) for b in spec.buckets] if spec.buckets else None
    frames, height, width, bucket = spec.frames, spec.height, spec.width, None
    resize = resize_policy_of(spec.resize)
    if policy.kind == "head":
        clip = head_frames(media, max(b.frames for b in buckets) if buckets else spec.frames, limits=limits)
        if buckets:
            bucket = choose_bucket(buckets, len(clip.frames), clip.source_height, clip.source_width)
            frames, height, width = bucket.frames, bucket.height, bucket.width
        if len(clip.frames) < frames and (buckets or policy.short == "skip"):
            raise InputError("clip_too_short", f"the clip decodes to {len(clip.frames)} frame(s); {frames} needed")
        clip = _held(clip, frames)
        return PreparedVideo(resize_pixels(clip.frames[:frames], height, width, resize), clip, bucket)
    if policy.kind == "span":  # the pixels are made as the frames are decoded: no clip of source frames is held
        clip = sample_frames(media, spec.frames, limits=limits, target=PixelTarget(height, width, resize))
        if clip.source_frames < frames and policy.short == "skip":
            raise InputError("clip_too_short", f"the clip has {clip.source_frames} frame(s); span needs {frames}")
    else:
        choose = functools.partial(_indices, policy, frames, window)
        clip = pick_frames(media, choose, limits=limits, target=PixelTarget(height, width, resize))
    return PreparedVideo(clip.pixels[:, :, :frames], dataclasses.replace(clip, pixels=None), bucket)  # held once


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
    the display-matrix rotation (degrees counter-clockwise) of a rotated clip, whose frames are kept as stored."""
    record: dict[str, Any] = {
        "source_fps": round(clip.fps, 6),
        "fps": round(effective_fps(clip.indices, clip.fps), 6),
        "indices": list(clip.indices),
    }
    if clip.rotation:
        record["rotation"] = clip.rotation
    return record


def read_sample(ref: SampleRef) -> tuple[str, bytes]:
    """(prompt, video bytes) of a sample, after its layout checks; InputError for what cannot be encoded. Runs on
    the shard loop's thread (a source's reader is not shared across threads)."""
    if "layout_error" in ref.extra:
        raise InputError("bad_layout", ref.extra["layout_error"])
    if "duplicate_of" in ref.extra:
        raise InputError(
            "duplicate_id", f"{ref.group}/{ref.id} is also {ref.extra['duplicate_of']}, met first: that one is encoded"
        )
    prompt = decode_prompt(ref.read_prompt())
    media = ref.read_media()
    if media is None:
        raise InputError("missing_video", "the sample has no video file")
    return prompt, media


def prepare_pixels(media: bytes, spec: CacheSpec, window: int | None, limits: MediaLimits) -> PreparedVideo:
    """`prepare_video` without the source-resolution frames: what waits for the encoder holds only the pixels."""
    video = prepare_video(media, spec, window, limits)
    return dataclasses.replace(video, clip=dataclasses.replace(video.clip, frames=video.clip.frames[:0].copy()))


def prepared_video(plan: BuildPlan) -> Callable[[SampleRef, bytes], PreparedVideo]:
    """`prepare_video` of one sample's bytes under the plan (what the prefetcher runs in its threads), without the
    source-resolution frames (the encoder needs the pixels; a sample waiting in the prefetch queue holds only them):
    the decode-ahead process's result for the same bytes and recipe where it has one (`infra.preprocess.ahead`)."""

    def prepare(ref: SampleRef, media: bytes) -> PreparedVideo:
        limits = media_limits(plan)
        held = ahead.take(ref, plan.spec, limits)  # decoded by the start-up process
        return held if held is not None else prepare_pixels(media, plan.spec, ref.window, limits)

    return prepare


def prefetcher_for(
    plan: BuildPlan, refs: Iterator[SampleRef], wanted: Callable[[SampleRef], bool]
) -> prefetch.Prefetcher | None:
    """A shard's read-ahead (`infra.preprocess.prefetch`) over the samples `wanted`; None without one
    (``--prefetch 0 --text-batch 1``, or ``windows:K``, whose samples are made from their clip as it is visited)."""
    cfg = plan.config
    serial = cfg.prefetch == 0 and cfg.text_batch == 1 and cfg.video_batch == 1
    if serial or plan.spec.temporal_policy().kind == "windows":
        return None
    ahead.hand_over()  # the shard's own decoders take over from the start-up process
    return prefetch.Prefetcher(
        refs,
        read=read_sample,
        decode=prepared_video(plan),
        wanted=wanted,
        depth=max(cfg.prefetch, cfg.video_batch - 1),  # a batch is made of samples already prepared
        lookahead=cfg.text_batch - 1,
        workers=cfg.decode_workers,
    )


def _prepared(ref: SampleRef, plan: BuildPlan) -> tuple[str, bytes, PreparedVideo]:
    """The sample's prompt, bytes and pixels: as the shard's prefetcher prepared them, else prepared now."""
    reading = prefetch.active()
    taken = reading.take(ref) if reading is not None else None
    prompt, media = taken[:2] if taken is not None else read_sample(ref)
    video = taken[2] if taken is not None and taken[2] is not None else prepared_video(plan)(ref, media)
    return prompt, media, video


def encode_text(encoder: LoadedFamily, prompt: str, plan: BuildPlan) -> TextEmbedding:
    """The prompt's embedding: held by the process's text cache, or encoded now in one batch with upcoming prompts
    (``--text-batch``, ``--text-cache-mb``)."""
    cfg = plan.config
    cache = texts.cache_for(encoder, cfg.text_cache_mb * 2**20)
    ahead = prefetch.active()
    upcoming = ahead.upcoming() if ahead is not None and cfg.text_cache_mb else []
    settings = plan.spec.text_settings()
    if cfg.text_offload:  # encoded in the shard's text phase; a prompt not held brings the parked encoder back
        held = cache.lookup(prompt, settings)
        if held is not None:
            return held
        with memory.text_in_use(encoder):
            return cache.embedding(encoder, prompt, settings, upcoming=upcoming, batch=cfg.text_batch)
    return cache.embedding(encoder, prompt, settings, upcoming=upcoming, batch=cfg.text_batch)


def encode_sample(
    ref: SampleRef, plan: BuildPlan, get_encoder: Callable[[], LoadedFamily]
) -> tuple[EncodedSample, dict]:
    """Decode, sample, resize and encode one sample (its audio too, for an audio spec). Raises InputError for bad
    input. Inputs are checked before the model is asked for, so a run of bad inputs never loads a model.

    A clip without an audio track (or whose audio cannot be decoded) in an audio run is still encoded: its row
    records the missing audio with the reason (``extras["missing_outputs"]``), and reconciliation and the audio
    gate count it as a loss."""
    spec = plan.spec
    prompt, media, video = _prepared(ref, plan)
    fault_point("decode")
    encoder = get_encoder()
    store = STORE_DTYPES[spec.store_dtype]
    latents = videos.latents(latent_encoder(encoder, spec), ref, video.pixels, plan).to(store)  # as its consumer reads
    text = encode_text(encoder, prompt, plan) if "text_embeddings" in plan.kinds else None
    fault_point("encode")
    extras: dict[str, Any] = dict(text.extras) if text is not None else {}
    info: dict[str, Any] = {"fps": video.clip.fps, "geometry": tuple(int(n) for n in video.pixels.shape[2:])}
    info["sampling"] = sampling_record(video.clip)
    if spec.audio:
        audio, facts = _audio(encoder, ref, media, video.pixels.shape[2] / video.clip.fps)
        extras.update(audio)
        info.update(facts)
    embeds = None
    if text is not None:
        trimmed = spec.text_storage == "trimmed"
        embeds = (textpad.trim(text.embeds, text.seq_len) if trimmed else text.embeds).to(store)
    sample = EncodedSample(
        id=ref.id,
        group=ref.group,
        stem=ref.stem,
        prompt=prompt,
        latents=latents,
        text_embeds=embeds,
        seq_len=text.seq_len if text is not None else 0,
        source_shape=video.clip.source_shape,
        fingerprint=plan.fingerprint,
        extras=extras,
        info=info,
    )
    tokens = {"tokens_total": text.tokens_total, "truncated": text.truncated} if text is not None else {}
    return sample, tokens or {"tokens_total": 0, "truncated": False}


def _audio(
    encoder: LoadedFamily, ref: SampleRef, media: bytes, seconds: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """({audio_latents: tensor}, {audio_duration}) of the clip, or ({}, {missing_outputs: why it has none})."""
    data = ref.read_audio() if ref.read_audio is not None else media
    if data is None:
        return {}, {"missing_outputs": {AUDIO_KIND: "missing_audio: the sample's audio file is not there"}}
    try:
        audio = encoder.encode_audio(data, seconds)
    except InputError as exc:
        return {}, {"missing_outputs": {AUDIO_KIND: f"{exc.reason}: {exc.detail}"}}
    if audio is None:
        return {}, {"missing_outputs": {AUDIO_KIND: "no_audio_track: the file has no audio stream"}}
    return {AUDIO_KIND: audio.latents}, {"audio_duration": audio.duration}
