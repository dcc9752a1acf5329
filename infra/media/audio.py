"""Audio as the LTX-2 trainer prepares it, without torchaudio: decode, fit, downmix, resample, log-mel.

The trainer (ltx-trainer ``process_videos.py`` with ltx-core's ``AudioProcessor``) loads every channel with
``torchaudio.load``, trims or zero-pads to the clip's duration, folds the channels to stereo, resamples to
16 kHz with ``torchaudio.functional.resample`` and takes a Slaney log-mel spectrogram. Each step is rebuilt
here from the same torch operations: decoding goes through PyAV (the same libavcodec decoders, no
resampling and no downmix in FFmpeg), the sinc resampler repeats torchaudio's kernel construction and
strided convolution, and the mel spectrogram is ``torch.stft`` magnitude times a Slaney filter bank.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from functools import lru_cache

import av
import numpy as np
import torch
import torch.nn.functional as F

from infra.errors import InputError

logger = logging.getLogger(__name__)

#: The rate the LTX-2 audio VAE takes its mel spectrogram at.
AUDIO_RATE = 16_000

#: Defaults of ``torchaudio.functional.resample`` (``sinc_interp_hann``).
_LOWPASS_FILTER_WIDTH = 6
_ROLLOFF = 0.99

#: Floor of the magnitude mel spectrogram before the log, as in ltx-core's ``AudioProcessor``.
_LOG_FLOOR = 1e-5

#: Full scale of PyAV's integer sample formats (planar or packed): value / scale (after offset) is in [-1, 1].
_INT_SCALE: dict[str, tuple[float, float]] = {
    "u8": (128.0, 128.0),  # (offset, scale): (x - 128) / 128
    "s16": (0.0, 32768.0),
    "s32": (0.0, 2.0**31),
    "s64": (0.0, 2.0**63),
}


@dataclass(frozen=True)
class Waveform:
    """Audio samples of every channel at one rate."""

    samples: torch.Tensor  # (channels, n) float32
    rate: int

    @property
    def seconds(self) -> float:
        """Length in seconds: samples / rate."""
        return self.samples.shape[-1] / self.rate

    @property
    def channels(self) -> int:
        """Number of channels."""
        return self.samples.shape[0]


def decode_audio(data: bytes, *, max_seconds: float | None = None) -> Waveform | None:
    """The first audio stream of a media file (bytes) via PyAV: every channel, float32 in [-1, 1], at its own
    rate, trimmed to ``int(max_seconds * rate)`` samples.

    None when the file has no audio stream; ``InputError("audio_decode_error", ...)`` when it has one that cannot
    be decoded (or decodes to 0 samples), and also when the bytes cannot be opened as a media file at all: such
    a file is damaged, not silent, and must not be cached as a clip without sound.
    """
    if not data:
        raise InputError("audio_decode_error", "the media file has 0 bytes")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InputError("audio_decode_error", f"cannot open container: {exc}") from exc
    with container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        stream.codec_context.thread_count = 1
        return _decode_stream(container, stream, max_seconds)


def _decode_stream(
    container: av.container.InputContainer, stream: av.audio.stream.AudioStream, max_seconds: float | None
) -> Waveform:
    chunks: list[np.ndarray] = []
    rate: int | None = None
    channels: int | None = None
    limit: int | None = None
    total = 0
    try:
        for frame in container.decode(stream):
            if frame.samples == 0:
                continue
            block = _frame_to_float(frame)
            if rate is None:
                rate, channels = frame.sample_rate, block.shape[0]
                limit = None if max_seconds is None else int(max_seconds * rate)
            elif frame.sample_rate != rate or block.shape[0] != channels:
                raise InputError(
                    "audio_decode_error",
                    f"the audio stream changes from {channels} ch at {rate} Hz to "
                    f"{block.shape[0]} ch at {frame.sample_rate} Hz",
                )
            chunks.append(block)
            total += block.shape[1]
            if limit is not None and total >= limit:
                break
    except av.FFmpegError as exc:
        raise InputError("audio_decode_error", f"decoding failed after {total} samples: {exc}") from exc
    if rate is None or total == 0:
        raise InputError("audio_decode_error", "the audio stream decoded to 0 samples")
    samples = np.concatenate(chunks, axis=1)
    if limit is not None:
        samples = samples[:, :limit]
    if samples.shape[1] == 0:
        raise InputError("audio_decode_error", f"max_seconds={max_seconds} keeps 0 samples")
    logger.debug("decoded %d samples of %d channels at %d Hz", samples.shape[1], samples.shape[0], rate)
    return Waveform(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)), rate)


def _frame_to_float(frame: av.AudioFrame) -> np.ndarray:
    """(channels, samples) float32 of one decoded frame, whatever PyAV's sample format."""
    fmt = frame.format
    channels = len(frame.layout.channels)
    array = frame.to_ndarray()
    if not fmt.is_planar:  # packed: (1, samples * channels), interleaved
        array = array.reshape(-1, channels).T
    name = fmt.name.removesuffix("p")
    if name in ("flt", "dbl"):
        return array.astype(np.float32, copy=False)
    if name not in _INT_SCALE:
        raise InputError("audio_decode_error", f"unsupported sample format {fmt.name!r}")
    offset, scale = _INT_SCALE[name]
    return ((array.astype(np.float64) - offset) / scale).astype(np.float32)


def fit_duration(wave: Waveform, seconds: float) -> Waveform:
    """Trim or zero-pad (at the end) to ``int(seconds * rate)`` samples."""
    target = int(seconds * wave.rate)
    n = wave.samples.shape[-1]
    if n >= target:
        return Waveform(wave.samples[:, :target], wave.rate)
    return Waveform(F.pad(wave.samples, (0, target - n)), wave.rate)


def downmix_stereo(wave: Waveform) -> Waveform:
    """Two channels as the trainer folds them: mono duplicated, 5.1 and 7.1 by their weights, else the mean.

    5.1 is [L, R, C, LFE, Ls, Rs] (LFE dropped) and 7.1 is [L, R, C, LFE, Ls, Rs, Lb, Rb], FFmpeg's order.
    """
    x = wave.samples
    count = x.shape[0]
    if count == 2:
        return wave
    if count == 1:
        out = x.repeat(2, 1)
    elif count == 6:
        front, side = 1 / 2.414, 0.707 / 2.414
        left = front * x[0] + side * x[2] + side * x[4]
        right = front * x[1] + side * x[2] + side * x[5]
        out = torch.stack([left, right])
    elif count == 8:
        front, side = 1 / 3.121, 0.707 / 3.121
        left = front * x[0] + side * (x[2] + x[4] + x[6])
        right = front * x[1] + side * (x[2] + x[5] + x[7])
        out = torch.stack([left, right])
    else:
        out = x.mean(dim=0, keepdim=True).repeat(2, 1)
    return Waveform(out.contiguous(), wave.rate)


def resample(wave: Waveform, rate: int = AUDIO_RATE) -> Waveform:
    """``torchaudio.functional.resample(samples, wave.rate, rate)`` with its defaults (Hann-windowed sinc)."""
    if wave.rate <= 0 or rate <= 0:
        raise ValueError(f"sample rates must be positive, got {wave.rate} and {rate}")
    if wave.rate == rate:
        return wave
    gcd = math.gcd(wave.rate, rate)
    orig, new = wave.rate // gcd, rate // gcd
    kernel, width = _sinc_resample_kernel(orig, new, wave.samples.dtype)
    x = wave.samples
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    num_wavs, length = x.shape
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x[:, None], kernel, stride=orig)  # (num_wavs, new, frames)
    y = y.transpose(1, 2).reshape(num_wavs, -1)
    y = y[..., : math.ceil(new * length / orig)]
    return Waveform(y.reshape(*shape[:-1], y.shape[-1]), rate)


def _sinc_resample_kernel(orig: int, new: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """torchaudio's ``_get_sinc_resample_kernel`` for gcd-reduced rates: ((new, 1, 2*width + orig), width)."""
    lowpass = _LOWPASS_FILTER_WIDTH
    base_freq = min(orig, new) * _ROLLOFF  # below both Nyquists: anti-aliasing, and no edge artefacts up
    width = math.ceil(lowpass * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new + idx
    t *= base_freq
    t = t.clamp_(-lowpass, lowpass)
    window = torch.cos(t * math.pi / lowpass / 2) ** 2
    t *= math.pi
    scale = base_freq / orig
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    return kernels, width


@lru_cache(maxsize=8)
def _mel_bank(n_freqs: int, mel_bins: int, rate: int) -> torch.Tensor:
    """Slaney filter bank (n_freqs, mel_bins) float32 from 0 Hz to rate / 2, Slaney area-normalised."""
    # where audio is encoded only: a decoder process of a video build does not carry transformers (~60 MiB each)
    from transformers.audio_utils import mel_filter_bank  # noqa: PLC0415 - heavy (STYLE 12): audio builds only

    bank = mel_filter_bank(
        num_frequency_bins=n_freqs,
        num_mel_filters=mel_bins,
        min_frequency=0.0,
        max_frequency=rate / 2,
        sampling_rate=rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(bank.astype(np.float32))


def log_mel(wave: Waveform, *, n_fft: int = 1024, hop_length: int = 160, mel_bins: int = 64) -> torch.Tensor:
    """[channels, T, mel_bins] float32 log-mel, T = samples // hop_length + 1, f_max = rate / 2.

    torchaudio's ``MelSpectrogram(power=1, mel_scale="slaney", norm="slaney", center=True, pad_mode="reflect")``
    with a periodic Hann window of n_fft, then ``log(clamp(mel, 1e-5))``. The filter bank is built for
    ``wave.rate``. Reflect padding needs more than n_fft // 2 samples: shorter audio is ``InputError``.
    """
    x = wave.samples.to(torch.float32)
    if x.shape[-1] <= n_fft // 2:
        raise InputError("audio_too_short", f"{x.shape[-1]} samples, a spectrogram needs more than {n_fft // 2}")
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float32)
    spec = torch.stft(
        x,
        n_fft=n_fft,
        hop_length=hop_length,
        win_length=n_fft,
        window=window,
        center=True,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()  # (channels, n_fft // 2 + 1, T)
    mel = torch.matmul(spec.transpose(-1, -2), _mel_bank(n_fft // 2 + 1, mel_bins, wave.rate))
    return torch.log(torch.clamp(mel, min=_LOG_FLOOR)).contiguous()


def trainer_audio(data: bytes, seconds: float, pad: bool = True) -> tuple[torch.Tensor, float] | None:
    """The trainer's audio of one clip: (log-mel [2, T, 64] at 16 kHz, duration in seconds as it stores it).

    ``seconds`` is the processed video's num_frames / fps (a clip's own track, zero-padded when short), or for a
    separate audio file under the trainer's rule the longest bucket's F / 25 (trimmed, never padded: `pad`
    False). The duration is samples / source rate after the trim or pad, before resampling. None when the file
    has no audio stream.
    """
    wave = decode_audio(data, max_seconds=seconds)
    if wave is None:
        return None
    wave = downmix_stereo(fit_duration(wave, seconds) if pad else wave)  # decode_audio trimmed it already
    duration = wave.samples.shape[-1] / wave.rate
    return log_mel(resample(wave, AUDIO_RATE)), duration
