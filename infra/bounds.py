"""The sanity bounds of every configured size and count, and the checks of the config's strings.

A bound is far above what a real data set or machine uses and low enough that no value that passes asks for an
absurd allocation (``--height 1600000`` once asked the allocator for 522 TB, ``--frames 1000000001`` for a 7.5 GiB
index array before anything was decoded) or stops being a JSON integer (< 2^63) in a flow's parameters. The config
models (`infra.config`) apply them through `Field` bounds and validators, so a flag, a config file, a recipe and a
Prefect form all get the same check, before anything is allocated. Like `infra.config`, this module imports nothing
of the project but `infra.errors`.
"""

from __future__ import annotations

import re

from infra.errors import ConfigError

#: Height, width and a bucket's sides, in pixels (16K).
MAX_SIDE = 16_384
#: Frames of one sample (the longest trainer default, LTX-2's, is 257).
MAX_FRAMES = 10_000
#: Pixels of one VAE call, video_batch × frames × height × width: 257 frames of 4K (3840×2160) fit.
MAX_CALL_PIXELS = 2**31
#: Tokens of a prompt's embedding (text_max_length): 8× the longest family default (LTX-2's 1024).
MAX_TEXT_TOKENS = 8_192
#: Samples, rows and frames counted (--limit, --max-samples-per-shard, --chunk-size, shard sizes, --start ...).
MAX_COUNT = 10**12
#: Bytes (shard_bytes: 1 PiB).
MAX_BYTES = 2**50
#: MiB limits (1 TiB).
MAX_MB = 2**20
#: Seconds waited (approvals: a year).
MAX_SECONDS = 365 * 86_400
#: Seconds a lease on an OUT in an object store holds unrenewed (``LATENTFORGE_LEASE_SECONDS``): at least a second
#: (its heartbeat is a quarter of it), at most a day (a run that died holds OUT that long; a lease record whose expiry
#: is further ahead than this is not one latentforge wrote).
MIN_LEASE_SECONDS, MAX_LEASE_SECONDS = 1.0, 86_400.0
#: Frames per second of ``--temporal fps:N``, and seconds of an ``--audio-durations`` bucket.
MAX_FPS, MAX_AUDIO_SECONDS = 1_000.0, 86_400.0
#: Characters of any string setting (paths, names, a caption prefix).
MAX_TEXT_CHARS = 65_536

#: A bucket: ``WxHxF`` (an image bucket ``WxHx1``).
_BUCKET = re.compile(r"^\s*(\d{1,12})\s*[xX]\s*(\d{1,12})\s*[xX]\s*(\d{1,12})\s*$")


def text_problem(text: str) -> str | None:
    """Why `text` cannot be a setting's value (None when it can): a NUL (no path or name holds one), a lone
    surrogate (bytes that are not UTF-8: a flow's parameters, the run report and cache.json are UTF-8 JSON), or
    more than `MAX_TEXT_CHARS` characters."""
    if len(text) > MAX_TEXT_CHARS:
        return f"{len(text)} characters, over the bound of {MAX_TEXT_CHARS}"
    if "\0" in text:
        return "holds a NUL character"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"not UTF-8 text (a lone surrogate \\u{ord(text[exc.start]):04x}: bytes that are not UTF-8)"
    return None


def bucket_sizes(text: str) -> list[tuple[int, int, int]]:
    """``"768x512x49;512x512x49"`` → [(W, H, F), ...] in the given order; ConfigError names the bad part (not
    WxHxF, a zero size, a size over the bounds, given twice)."""
    parts = [part for part in text.split(";") if part.strip()]
    if not parts:
        raise ConfigError(f"--buckets {text[:80]!r}: no bucket given (expected WxHxF;WxHxF, e.g. 768x512x49)")
    sizes: list[tuple[int, int, int]] = []
    for part in parts:
        match = _BUCKET.fullmatch(part)
        shown = part.strip()[:80]
        if match is None:
            raise ConfigError(f"--buckets: {shown!r} is not WxHxF (three positive integers, e.g. 768x512x49)")
        width, height, frames = (int(g) for g in match.groups())
        if min(width, height, frames) <= 0:
            raise ConfigError(f"--buckets: {shown!r} has a zero size")
        if (width, height, frames) in sizes:
            raise ConfigError(f"--buckets: {shown!r} is given twice")
        check_geometry(frames, height, width, 1, f"--buckets {shown!r}")
        sizes.append((width, height, frames))
    return sizes


def check_geometry(frames: int, height: int, width: int, batch: int, what: str) -> None:
    """ConfigError when a sample's geometry is over the bounds: a side over `MAX_SIDE`, more than `MAX_FRAMES`
    frames, or more than `MAX_CALL_PIXELS` pixels in one VAE call of `batch` samples."""
    if max(height, width) > MAX_SIDE:
        raise ConfigError(f"{what}: {width}x{height} has a side over the bound of {MAX_SIDE} pixels")
    if frames > MAX_FRAMES:
        raise ConfigError(f"{what}: {frames} frames, over the bound of {MAX_FRAMES}")
    pixels = batch * frames * height * width
    if pixels > MAX_CALL_PIXELS:
        raise ConfigError(
            f"{what}: video_batch × frames × height × width = {batch} × {frames} × {height} × {width} = {pixels:,} "
            f"pixels per VAE call, over the bound of {MAX_CALL_PIXELS:,} (2^31: 257 frames of 4K fit)"
        )


def seconds_list(text: str, what: str) -> list[float]:
    """``"2.0;4.0;8.0"`` → [2.0, 4.0, 8.0]; ConfigError for a part that is not a number, not positive, not finite
    or over `MAX_AUDIO_SECONDS` (NaN and inf included)."""
    try:
        values = [float(part) for part in text.split(";")]
    except ValueError as exc:
        raise ConfigError(f"{what} {text[:80]!r}: expected seconds like 2.0;4.0;8.0") from exc
    if any(not 0 < v <= MAX_AUDIO_SECONDS for v in values):  # NaN and inf fail this too
        raise ConfigError(f"{what} {text[:80]!r}: every duration must be positive and at most {MAX_AUDIO_SECONDS:g} s")
    return values


def seconds_between(text: str, what: str, low: float, high: float) -> float:
    """``text`` as seconds from `low` to `high` (NaN and inf refused); ConfigError naming `what` otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what}={text[:80]!r}: a number of seconds from {low:g} to {high:g}") from None
    if not low <= value <= high:  # NaN fails this too
        raise ConfigError(f"{what}={text[:80]!r}: a number of seconds from {low:g} to {high:g}")
    return value
