"""infra.media.audio: the LTX-2 trainer's audio front end, each step checked against a reference written here.

The references share no code with the module: the log-mel is recomputed with numpy (reflect padding, a
periodic Hann window, ``np.fft.rfft`` per frame, a Slaney filter bank written from the Slaney formulas),
and the resampler against the windowed-sinc interpolation formula it implements, evaluated in float64.
"""

from __future__ import annotations

import io
import math
from functools import cache

import av
import numpy as np
import pytest
import torch

from infra.demo.testmedia import real_clip
from infra.errors import InputError
from infra.media.audio import (
    AUDIO_RATE,
    Waveform,
    decode_audio,
    downmix_stereo,
    fit_duration,
    log_mel,
    resample,
    trainer_audio,
)

N_FFT, HOP, MELS = 1024, 160, 64
LOG_FLOOR = math.log(1e-5)


@cache
def clip(name: str) -> bytes:
    """A real clip's bytes, read once per test session."""
    return real_clip(name).read_bytes()


def tone(freq: float, rate: int, n: int, amplitude: float = 0.5) -> np.ndarray:
    """A sine of `freq` Hz, float32."""
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(n) / rate)).astype(np.float32)


def wave_of(*channels: np.ndarray, rate: int) -> Waveform:
    return Waveform(torch.from_numpy(np.stack(channels).astype(np.float32)), rate)


def pcm_file(samples: np.ndarray, rate: int, codec: str, fmt: str, layout: str) -> bytes:
    """A WAV file in memory holding `samples` (packed, as PyAV takes them: (1, n * channels))."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as dst:
        stream = dst.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples, format=fmt, layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            dst.mux(packet)
        for packet in stream.encode(None):
            dst.mux(packet)
    return buf.getvalue()


# ---- numpy reference of the log-mel spectrogram ----------------------------------------------------------


def slaney_hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's Auditory Toolbox scale: linear (200/3 Hz per mel) below 1 kHz, log (6.4 per 27 mels) above."""
    f = np.asarray(f, dtype=np.float64)
    lin = f / (200.0 / 3.0)
    log = 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, lin)


def slaney_mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((m - 15.0) * np.log(6.4) / 27.0), m * 200.0 / 3.0)


def slaney_bank(rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """(n_fft//2+1, n_mels): triangles on mel-spaced edges from 0 to rate/2, each scaled by 2 / its width in Hz."""
    fft_hz = np.linspace(0.0, rate // 2, n_fft // 2 + 1)
    edges = slaney_mel_to_hz(np.linspace(0.0, slaney_hz_to_mel(rate / 2), n_mels + 2))
    bank = np.zeros((fft_hz.size, n_mels))
    for m in range(n_mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        rising = (fft_hz - lo) / (mid - lo)
        falling = (hi - fft_hz) / (hi - mid)
        bank[:, m] = np.clip(np.minimum(rising, falling), 0.0, None) * 2.0 / (hi - lo)
    return bank


def numpy_log_mel(x: np.ndarray, rate: int) -> np.ndarray:
    """[T, mels] of one channel: centred frames (reflect pad n_fft/2), periodic Hann, |rfft|, Slaney mel, log."""
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic: N in the denominator
    frames = 1 + (padded.size - N_FFT) // HOP
    spec = np.stack([np.abs(np.fft.rfft(padded[t * HOP : t * HOP + N_FFT] * window)) for t in range(frames)])
    return np.log(np.maximum(spec @ slaney_bank(rate, N_FFT, MELS), 1e-5))


def test_log_mel_of_tones_matches_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    n = AUDIO_RATE  # 1 s
    noise = (0.01 * rng.standard_normal(n)).astype(np.float32)  # lifts every bin well above the log floor
    one_k = tone(1000, AUDIO_RATE, n) + noise
    two_tone = tone(440, AUDIO_RATE, n, 0.3) + tone(3000, AUDIO_RATE, n, 0.2) + noise
    mel = log_mel(wave_of(one_k, two_tone, rate=AUDIO_RATE))
    assert mel.dtype == torch.float32
    assert mel.shape == (2, n // HOP + 1, MELS)
    for channel, x in enumerate((one_k, two_tone)):
        np.testing.assert_allclose(mel[channel].numpy(), numpy_log_mel(x, AUDIO_RATE), atol=1e-4, rtol=0)


def test_log_mel_peak_is_the_band_holding_the_tone() -> None:
    mel = log_mel(wave_of(tone(1000, AUDIO_RATE, AUDIO_RATE), rate=AUDIO_RATE))[0]
    bank = slaney_bank(AUDIO_RATE, N_FFT, MELS)
    band = int(np.argmax(bank[round(1000 * N_FFT / AUDIO_RATE)]))  # 1 kHz is exactly FFT bin 64
    middle = mel[10:-10]  # frames whose window lies inside the signal
    assert (middle.argmax(dim=1) == band).all()
    # Pure tone without noise: the far bands sit on (or near) the log floor, never below it.
    assert mel.min().item() >= LOG_FLOOR - 1e-6


def test_log_mel_rejects_audio_shorter_than_half_a_window() -> None:
    with pytest.raises(InputError) as err:
        log_mel(Waveform(torch.zeros(2, N_FFT // 2), AUDIO_RATE))
    assert err.value.reason == "audio_too_short"


# ---- resampling ---------------------------------------------------------------------------------------------


def sinc_resample_reference(x: np.ndarray, orig: int, new: int) -> np.ndarray:
    """y[n] = sum_i x[i]·s·sinc(b(i/orig − n/new))·cos²(π b(i/orig − n/new)/12) for |·| ≤ 6, in float64.

    b = min(orig, new)·0.99 and s = b/orig: torchaudio's Hann-windowed sinc with lowpass_filter_width=6,
    rolloff=0.99; samples outside the signal are zeros; ceil(new·len/orig) outputs.
    """
    base = min(orig, new) * 0.99
    out_n = math.ceil(new * x.size / orig)
    arg = base * (np.arange(x.size)[None, :] / orig - np.arange(out_n)[:, None] / new)
    arg = np.clip(arg, -6.0, 6.0)
    kernel = np.sinc(arg) * np.cos(np.pi * arg / 12.0) ** 2 * (base / orig)
    return kernel @ x.astype(np.float64)


@pytest.mark.parametrize("orig", [48_000, 44_100, 22_050, 8_000])
def test_resample_matches_the_windowed_sinc_formula(orig: int) -> None:
    x = np.random.default_rng(orig).uniform(-0.5, 0.5, size=(2, orig // 20)).astype(np.float32)  # 50 ms
    got = resample(Waveform(torch.from_numpy(x), orig), AUDIO_RATE)
    assert got.rate == AUDIO_RATE
    assert got.samples.dtype == torch.float32
    assert got.samples.shape == (2, math.ceil(AUDIO_RATE * x.shape[1] / orig))
    # Like torchaudio, the kernel is built in the waveform's dtype: in float64 it is the formula to rounding,
    # in float32 the kernel's phases (k/441 and the like) carry float32 rounding, some 1e-5 at most.
    exact = resample(Waveform(torch.from_numpy(x.astype(np.float64)), orig), AUDIO_RATE).samples
    for channel in range(2):
        ref = sinc_resample_reference(x[channel], orig, AUDIO_RATE)
        np.testing.assert_allclose(exact[channel].numpy(), ref, atol=1e-12, rtol=0)
        np.testing.assert_allclose(got.samples[channel].numpy(), ref, atol=5e-5, rtol=0)


def test_resample_to_the_same_rate_is_the_identity() -> None:
    wave = wave_of(tone(1000, AUDIO_RATE, 1000), rate=AUDIO_RATE)
    same = resample(wave, AUDIO_RATE)
    assert same.rate == AUDIO_RATE
    assert torch.equal(same.samples, wave.samples)


def peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spectrum) * rate / x.size)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


@pytest.mark.parametrize("orig", [48_000, 44_100])
def test_resample_keeps_a_tone(orig: int) -> None:
    n = orig + 7  # not a multiple of the reduced rates: the length rounds up
    x = tone(1000, orig, n)
    out = resample(wave_of(x, rate=orig), AUDIO_RATE).samples[0].numpy()
    assert out.size == math.ceil(AUDIO_RATE * n / orig)
    assert abs(peak_hz(out, AUDIO_RATE) - 1000) <= AUDIO_RATE / out.size
    assert rms(out) == pytest.approx(rms(x), rel=0.01)


def test_resample_low_pass_removes_what_would_alias() -> None:
    orig, n = 48_000, 48_000
    kept = tone(7900, orig, n)
    aliased = tone(12_000, orig, n)  # above the new Nyquist: would fold onto 4 kHz
    out = resample(wave_of(kept, aliased, rate=orig), AUDIO_RATE).samples.numpy()
    inner = slice(200, -200)  # away from the zero-padded edges
    passed_db = 20 * math.log10(rms(out[0][inner]) / rms(kept))
    stopped_db = 20 * math.log10(rms(out[1][inner]) / rms(aliased))
    assert stopped_db < -40
    assert stopped_db < passed_db - 30


# ---- channels and duration ---------------------------------------------------------------------------------


def test_downmix_5_1_uses_the_trainer_weights() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.25], [9.0, -9.0], [0.25, 1.0], [-1.0, 0.5]])
    out = downmix_stereo(Waveform(x, 48_000))
    left = x[0] / 2.414 + 0.707 * x[2] / 2.414 + 0.707 * x[4] / 2.414
    right = x[1] / 2.414 + 0.707 * x[2] / 2.414 + 0.707 * x[5] / 2.414
    assert out.rate == 48_000
    assert out.samples.shape == (2, 2)
    torch.testing.assert_close(out.samples, torch.stack([left, right]), rtol=1e-6, atol=1e-7)
    # By hand, first sample: L = (1 + 0.707*0.5 + 0.707*0.25) / 2.414; the LFE (9.0) is dropped.
    assert out.samples[0, 0].item() == pytest.approx((1 + 0.707 * 0.75) / 2.414, rel=1e-6)
    assert out.samples[1, 0].item() == pytest.approx((0.707 * 0.5 - 0.707) / 2.414, rel=1e-6)


def test_downmix_7_1_uses_the_trainer_weights() -> None:
    x = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 10
    out = downmix_stereo(Waveform(x, 48_000)).samples
    left = x[0] / 3.121 + 0.707 * (x[2] + x[4] + x[6]) / 3.121
    right = x[1] / 3.121 + 0.707 * (x[2] + x[5] + x[7]) / 3.121
    torch.testing.assert_close(out, torch.stack([left, right]), rtol=1e-6, atol=1e-7)


def test_downmix_mono_stereo_and_other_counts() -> None:
    mono = torch.tensor([[0.1, -0.2, 0.3]])
    assert torch.equal(downmix_stereo(Waveform(mono, 8000)).samples, mono.repeat(2, 1))
    stereo = Waveform(torch.tensor([[0.1, 0.2], [0.3, 0.4]]), 8000)
    assert downmix_stereo(stereo) is stereo
    three = torch.tensor([[0.3, 0.0], [0.6, 0.3], [0.0, -0.9]])
    torch.testing.assert_close(downmix_stereo(Waveform(three, 8000)).samples, torch.tensor([[0.3, -0.2]] * 2))


def test_fit_duration_trims_and_pads_with_zeros() -> None:
    wave = Waveform(torch.ones(2, 100), 1000)
    trimmed = fit_duration(wave, 0.0375)
    assert trimmed.samples.shape == (2, 37)
    padded = fit_duration(wave, 0.25)
    assert padded.samples.shape == (2, 250)
    assert torch.equal(padded.samples[:, :100], wave.samples)
    assert torch.count_nonzero(padded.samples[:, 100:]) == 0
    assert padded.seconds == 0.25


# ---- decoding ----------------------------------------------------------------------------------------------


def test_decode_bigbuckbunny_every_channel_at_its_rate() -> None:
    full = decode_audio(clip("bigbuckbunny"))
    assert full is not None
    assert full.rate == 48_000
    assert full.samples.shape[0] == 6  # AAC 5.1, FFmpeg's order [FL, FR, FC, LFE, BL, BR]
    assert full.samples.dtype == torch.float32
    assert full.samples.abs().max().item() <= 1.0
    assert full.samples.abs().max().item() > 0.01  # not silence
    cut = decode_audio(clip("bigbuckbunny"), max_seconds=1.3)
    assert cut is not None
    assert cut.samples.shape == (6, int(1.3 * 48_000))
    assert torch.equal(cut.samples, full.samples[:, : int(1.3 * 48_000)])


def test_decode_other_real_clips() -> None:
    assert decode_audio(clip("bikes")) is None  # no audio stream
    stereo = decode_audio(clip("sample_1080p"))
    assert stereo is not None
    assert (stereo.samples.shape[0], stereo.rate) == (2, 48_000)
    only_audio = decode_audio(clip("audio_only"))
    assert only_audio is not None
    assert (only_audio.samples.shape[0], only_audio.rate) == (2, 44_100)


@pytest.mark.parametrize("data", [b"", b"\x00garbage, not a media file" * 40])
def test_decode_bytes_that_are_no_media_file(data: bytes) -> None:
    # A file PyAV cannot open is damaged, not silent: an error of the sample, never "no audio".
    with pytest.raises(InputError) as err:
        decode_audio(data)
    assert err.value.reason == "audio_decode_error"


def test_decode_truncated_container_is_an_error() -> None:
    with pytest.raises(InputError) as err:
        decode_audio(clip("truncated_mkv"))
    assert err.value.reason == "audio_decode_error"


def test_decode_packed_integer_formats() -> None:
    rate, n = 8000, 400
    s16 = np.stack([np.arange(n) * 80 - 16000, 32767 - np.arange(n) * 163]).astype(np.int16)  # (2, n)
    data = pcm_file(s16.T.reshape(1, -1).copy(), rate, "pcm_s16le", "s16", "stereo")
    wave = decode_audio(data)
    assert wave is not None
    assert wave.rate == rate
    np.testing.assert_array_equal(wave.samples.numpy(), s16.astype(np.float32) / 32768)

    u8 = (np.arange(n) % 256).astype(np.uint8)[None]
    wave = decode_audio(pcm_file(u8, rate, "pcm_u8", "u8", "mono"))
    assert wave is not None
    np.testing.assert_array_equal(wave.samples.numpy(), (u8.astype(np.float32) - 128) / 128)

    s32 = (np.arange(n, dtype=np.int64) * 5_000_000 - 2**31).astype(np.int32)[None]
    wave = decode_audio(pcm_file(s32, rate, "pcm_s32le", "s32", "mono"))
    assert wave is not None
    np.testing.assert_allclose(wave.samples.numpy(), s32 / 2**31, rtol=1e-7)


# ---- the whole front end -----------------------------------------------------------------------------------


def test_trainer_audio_on_bigbuckbunny() -> None:
    seconds = 33 / 25
    got = trainer_audio(clip("bigbuckbunny"), seconds)
    assert got is not None
    mel, duration = got
    kept = int(seconds * 48_000)
    n16 = math.ceil(AUDIO_RATE * kept / 48_000)
    assert mel.shape == (2, n16 // HOP + 1, MELS)
    assert mel.dtype == torch.float32
    assert duration == kept / 48_000
    assert torch.isfinite(mel).all()
    assert mel.max().item() > LOG_FLOOR + 5  # there is sound
    # The same steps by hand give the same spectrogram.
    wave = decode_audio(clip("bigbuckbunny"))
    assert wave is not None
    by_hand = log_mel(resample(downmix_stereo(fit_duration(wave, seconds))))
    assert torch.equal(mel, by_hand)


def test_trainer_audio_without_audio_stream() -> None:
    assert trainer_audio(clip("bikes"), 33 / 25) is None


def test_trainer_audio_pads_a_short_clip_with_silence() -> None:
    rate = 8000
    mono = (np.round(tone(440, rate, int(0.2 * rate)) * 32767)).astype(np.int16)[None]
    got = trainer_audio(pcm_file(mono, rate, "pcm_s16le", "s16", "mono"), 0.5)
    assert got is not None
    mel, duration = got
    assert duration == 0.5
    n16 = math.ceil(AUDIO_RATE * int(0.5 * rate) / rate)
    assert mel.shape == (2, n16 // HOP + 1, MELS)
    assert torch.equal(mel[0], mel[1])  # mono duplicated
    assert mel[:, :15].max().item() > LOG_FLOOR + 5  # the tone
    # Sound ends at 0.2 s (sample 3200 at 16 kHz, plus the resampler's few samples of ringing): frames whose
    # window starts after it see only the zero padding.
    first_silent = math.ceil((3200 + 20 + N_FFT // 2) / HOP)
    assert (mel[:, first_silent:] == torch.tensor(LOG_FLOOR)).all()
