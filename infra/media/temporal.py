"""Temporal sampling policies: which source frames a sample is made of.

* ``span``: F frames spread over the whole clip by linspace (the Wan2.2 VBVR recipe); a short clip repeats frames.
* ``head``: the first F frames (the LTX-2 trainer's).
* ``fps:N``: by time at N frames per second, as FastVideo computes it: frame i is ``round(i · native / N)``,
  clamped to the last frame.
* ``resample:N``: the clip put on an N fps timeline as FastVideo's MiniMax-H3 reader does (its
  ``resample_reference_frames``: source frame j fills the output slots from ``floor(j · N / native + 0.5)`` up to the
  next frame's; the stream as it is at N fps), then the first F; a clip with fewer is skipped.
* ``stride:K``: frame ``start``, then every K-th, as many as F needs.
* ``windows:K``: many samples per clip: every stride-K window of F frames (non-overlapping, or every
  ``window_step`` frames), each its own sample ``<id>@<first frame>``.

A clip too short for its policy is repeated (indices clamped to its last frame) or skipped with the reason and
the frame count (``short_clips``; per-policy default: ``span`` and ``fps`` repeat, the others skip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infra.config import CacheSpec, parse_temporal
from infra.errors import ConfigError, InputError

KINDS = ("span", "head", "fps", "resample", "stride", "windows")
#: The CacheSpec value of `span` is latentforge 0.1's name for it, so its caches keep their fingerprints.
SPEC_NAMES = {"span": "linspace"}
DEFAULT_SHORT = {
    "span": "repeat",
    "head": "skip",
    "fps": "repeat",
    "resample": "skip",
    "stride": "skip",
    "windows": "skip",
}


@dataclass(frozen=True)
class TemporalPolicy:
    kind: str
    value: float = 0  # fps:N's N, stride:K / windows:K's K
    start: int = 0
    window_step: int | None = None
    short: str = "repeat"

    @property
    def name(self) -> str:
        """The user's spelling: span, head, fps:24, stride:2, windows:2."""
        if self.kind in ("span", "head"):
            return self.kind
        number = int(self.value) if float(self.value).is_integer() else self.value
        return f"{self.kind}:{number}"

    @property
    def spec_value(self) -> str:
        return SPEC_NAMES.get(self.name, self.name)

    @classmethod
    def of(cls, spec: CacheSpec) -> TemporalPolicy:
        """The policy a spec was made with."""
        return make_policy(spec.temporal, spec.start, spec.window_step, spec.short_clips)


def make_policy(
    temporal: str, start: int | None = None, window_step: int | None = None, short: str | None = None
) -> TemporalPolicy:
    """A policy from the config's fields (a CacheSpec's `temporal` value is accepted too); ConfigError for
    options the policy does not take."""
    kind, value = parse_temporal(temporal)
    if start and kind not in ("stride", "windows"):
        raise ConfigError(f"--start is an offset for stride:K and windows:K, not for {kind}")
    if window_step is not None and kind != "windows":
        raise ConfigError("--window-step is for --temporal windows:K")
    if window_step is not None and window_step <= 0:
        raise ConfigError("--window-step must be positive")
    return TemporalPolicy(kind, value, start or 0, window_step, short or DEFAULT_SHORT[kind])


@dataclass(frozen=True)
class Window:
    """One sample's source frames: their indices (len F) and the first one (a `windows` sample's id suffix)."""

    indices: tuple[int, ...]

    @property
    def first(self) -> int:
        return self.indices[0]


def _too_short(total: int, needed: int, policy: TemporalPolicy) -> InputError:
    return InputError(
        "clip_too_short", f"the clip has {total} frame(s); {policy.name} needs {needed} (--short-clips skip)"
    )


def _clamped(indices: np.ndarray, total: int, policy: TemporalPolicy, frames: int | None = None) -> tuple[int, ...]:
    """`indices` clamped to the clip; `frames` given: `indices` may be fewer (a resampled timeline that ends
    early), repeated at the last one to `frames` unless the policy skips."""
    if frames is not None and len(indices) < frames:
        if policy.short == "skip":
            raise InputError(
                "clip_too_short", f"the clip makes {len(indices)} frame(s) at {policy.name}; F needs {frames}"
            )
        indices = np.concatenate([indices, np.full(frames - len(indices), indices[-1] if len(indices) else 0)])
    needed = int(indices[-1]) + 1
    if needed > total and policy.short == "skip":
        raise _too_short(total, needed, policy)
    return tuple(int(i) for i in np.minimum(indices, total - 1))


def resampled_indices(total: int, native_fps: float, rate: float) -> np.ndarray:
    """The source frame of each output frame of a clip of `total` frames put on a `rate` timeline by FastVideo's
    ``resample_reference_frames`` (each source frame repeated ``diff(floor(j · rate / native + 0.5))`` times)."""
    if native_fps == rate:
        return np.arange(total)
    scale = rate / native_fps
    slots = np.floor(np.arange(total) * scale + 0.5).astype(np.int64)
    repeats = np.diff(slots, append=math.floor(total * scale + 0.5))
    return np.repeat(np.arange(total), repeats)


def frames_seconds(spec: CacheSpec, frames: int, native_fps: float) -> float:
    """How long the stored frames last, what a clip's audio is cut to: F / N under ``resample:N`` (the frames are on
    an N fps timeline), else F / the stream's rate (the LTX-2 trainer's num_frames / fps)."""
    kind, value = parse_temporal(spec.temporal)
    return frames / (value if kind == "resample" else native_fps)


def choose_windows(policy: TemporalPolicy, total: int, native_fps: float, frames: int) -> list[Window]:
    """The windows of a clip of `total` frames at `native_fps` under `policy`, F = `frames` each. InputError
    ``clip_too_short`` (with the frame count) when the clip is too short and the policy skips."""
    if total <= 0:
        raise InputError("no_frames", "the video stream has no frames")
    if policy.kind == "span":
        if total < frames and policy.short == "skip":
            raise _too_short(total, frames, policy)
        return [Window(tuple(int(i) for i in np.linspace(0, total - 1, frames).round().astype(np.int64)))]
    if policy.kind == "head":
        return [Window(_clamped(np.arange(frames), total, policy))]
    if policy.kind == "fps":
        # FastVideo: round(i * native / target); a float multiply first, as numpy rounds half to even
        raw = np.round(np.arange(frames) * (native_fps / policy.value)).astype(np.int64)
        return [Window(_clamped(raw, total, policy))]
    if policy.kind == "resample":
        return [Window(_clamped(resampled_indices(total, native_fps, policy.value)[:frames], total, policy, frames))]
    step = int(policy.value)
    offsets = np.arange(frames) * step
    if policy.kind == "stride":
        return [Window(_clamped(policy.start + offsets, total, policy))]
    length = int(offsets[-1]) + 1  # windows
    every = policy.window_step or length
    starts = list(range(policy.start, total - length + 1, every))
    if not starts:
        if policy.short == "skip":
            raise _too_short(total, policy.start + length, policy)
        return [Window(_clamped(policy.start + offsets, total, policy))]
    return [Window(tuple(int(s + o) for o in offsets)) for s in starts]


def effective_fps(indices: tuple[int, ...], native_fps: float) -> float:
    """The frame rate the chosen frames play at: native / the mean index step (native for a single frame)."""
    if len(indices) < 2 or indices[-1] == indices[0]:
        return native_fps
    return native_fps * (len(indices) - 1) / (indices[-1] - indices[0])


def vae_aligned_indices(frames: int, factor: int) -> list[int]:
    """The LTX-2 trainer's temporal subsampling of a reference video: frame 0 (the VAE's first latent frame stands
    alone), then every `factor`-th frame from frame 1 on."""
    return list(range(frames)) if factor == 1 else [0, *range(1, frames, factor)]
