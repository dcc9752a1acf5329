"""MiniMax-H3 (joint video + stereo audio) from a local snapshot of its Modular Diffusers repository
(``modular_model_index.json``: two transformer partitions over shared components). latentforge reads the shared
encoding components only: ``vae/`` (``AutoencoderKLMiniMaxH3``, float32 as released), ``text_encoder/`` (the Qwen3-VL
conditioner), ``tokenizer/``, and for an audio run ``audio_vae/`` (``AutoencoderKLMiniMaxH3Audio``, float32). What is
cached is what diffusers' ``MiniMaxH3Blocks`` encode (``modular_pipelines/minimax_h3``), as the trainers cache it:

* video: the frames as uint8 ``u``, ``u / 255``, ImageNet-normalised (``(x - mean) / std``), the VAE's posterior
  (17n+5 frames in 17-frame chunks, 3 trailing latent frames dropped: 5n+2; spatially tiled as released), then
  ``(z - latents_mean) / latents_std`` with the VAE config's statistics, ``[24, F', H/16, W/16]``. ``z`` is the
  posterior mean, or, where the consumer caches a sample (FastVideo), ``mean + std · ε`` with ε drawn from a CPU
  generator seeded 42 for each clip (`encode_sampled_videos`);
* text: the prompt verbatim, tokenized with no special tokens and no chat template (the t2va presentation), the
  conditioner's ``hidden_states[50]`` (after 50 decoder layers, before the final norm) in the compute dtype,
  ``[L, 5120]`` with zero rows past the prompt's L tokens up to ``max_length`` (the consumers pad with zeros);
* audio: the clip's track for the frames stored (F / 24 s at H3's 24 fps), trimmed or zero-padded, stereo (mono
  duplicated; of more channels the first two, FFmpeg's front left and right, as DiffSynth-Studio takes them),
  resampled to 32 kHz as ``torchaudio.functional.resample`` does, the two channels as two batch items of the mono
  audio VAE, its posterior mean normalised per latent channel: float32 ``[2, 32, T]``, 40 latents a second.

The conditioner and the float32 video VAE do not fit one 24 GB card together: each is put on the device when its
stage needs it (`release_vae`: ``--text-offload`` brings the text encoder back only after the VAE left the device).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.errors import ConfigError, InputError
from infra.media.audio import Waveform, decode_audio, fit_duration, log_mel, resample
from infra.models.base import (
    TOKENIZER_LOCK,
    AudioEmbedding,
    FamilySpec,
    GeometryRules,
    LoadedFamily,
    TextEmbedding,
    TextSettings,
    read_json,
)

logger = logging.getLogger(__name__)

#: The Modular pipeline's facts (diffusers' ``MiniMaxH3ModularPipeline``): its frame rate, the hidden state the
#: transformer is conditioned on, the pixel convention of the video VAE, the stereo channels, the sampling seed.
FPS = 24
TEXT_LAYER = 50
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
AUDIO_CHANNELS = 2
SAMPLE_SEED = 42
#: The log-mel decode-and-verify compares (per channel) at the audio VAE's rate: 1024-point FFT, 10 ms hop, 64 bins.
MEL_HOP_SECONDS = 0.01
VIDEO_VAE = "AutoencoderKLMiniMaxH3"


class H3Spec(FamilySpec):
    """Detection, constraints and loading for the h3 family (MiniMax-H3, t2va)."""

    name = "h3"
    components = ("vae", "text_encoder", "tokenizer")
    latent_norm = "(posterior.mean - latents_mean) / latents_std, fp32 (ImageNet-normalised [0, 1] pixels)"
    defaults: ClassVar[dict[str, Any]] = {
        "temporal": f"resample:{FPS}",
        "resize": "h3-lanczos",
        "text_max_length": 1024,
        "text_stage": f"hidden_states_{TEXT_LAYER}",
    }
    text_stages = (f"hidden_states_{TEXT_LAYER}",)
    has_audio = True
    text_8bit = True
    store_dtypes = ("bf16", "fp32")
    #: The policies whose pixels hold uint8 values exactly (the family takes them back to scale them as its VAE does).
    resize_policies = ("h3-lanczos",)

    def components_for(self, audio: bool) -> tuple[str, ...]:
        return (*self.components, "audio_vae") if audio else self.components

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae")
        return isinstance(vae, list) and len(vae) >= 2 and vae[1] == VIDEO_VAE

    def _vae(self, model_dir: Path) -> dict[str, Any]:
        return read_json(model_dir / "vae" / "config.json")

    def rules(self, model_dir: Path) -> GeometryRules:
        chunk, kept, spatial, _ = _geometry(self._vae(model_dir))
        return GeometryRules(frame_multiple=chunk, frame_remainder=kept, spatial_multiple=spatial * 2)

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = self._vae(model_dir)
        chunk, kept, spatial, channels = _geometry(cfg)
        latent_frames = (frames - kept) // chunk * kept + kept - int(cfg.get("token_drop", 3))
        return (channels, latent_frames, height // spatial, width // spatial)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        cfg = read_json(model_dir / "text_encoder" / "config.json")
        return (settings.max_length, int(cfg.get("text_config", cfg)["hidden_size"]))

    def load(
        self, model_dir: Path, device: torch.device, dtype: torch.dtype, text_encoder_8bit: bool = False
    ) -> H3Encoder:
        return H3Encoder(model_dir, device, dtype, text_encoder_8bit)


def _geometry(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(frames per chunk, latent frames a chunk keeps, spatial compression, latent channels) of a video VAE config."""
    chunk = int(cfg.get("clip_length", 17))
    temporal = math.prod(int(f) for f in cfg.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
    spatial = math.prod(int(f) for f in cfg.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
    return chunk, math.ceil(chunk / temporal), spatial, int(cfg.get("latent_channels", 24))


class H3Encoder(LoadedFamily):
    """The loaded video VAE, conditioner and tokenizer; the audio VAE on first use. Calls are serialised."""

    name = "h3"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, text_8bit: bool = False) -> None:
        from diffusers import AutoencoderKLMiniMaxH3  # noqa: PLC0415 - heavy imports, only when loading
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.model_dir, self.device, self.dtype, self.text_8bit = model_dir, device, dtype, text_8bit
        self.vae = AutoencoderKLMiniMaxH3.from_pretrained(
            model_dir / "vae", torch_dtype=torch.float32, local_files_only=True
        ).eval()
        self._vae_here = False
        self.text_encoder = self.load_text_encoder()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
        cfg = self.vae.config
        self.mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.pixel_mean = torch.tensor(PIXEL_MEAN, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.pixel_std = torch.tensor(PIXEL_STD, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self._audio_vae: Any = None
        self._lock = threading.RLock()
        logger.info("loaded h3 from %s on %s (%s%s)", model_dir, device, dtype, text_8bit * ", 8-bit text")

    # ------------------------------------------------------------------------------------------------ stages

    def _on_device(self) -> Any:
        """The video VAE on the device (the video stage): it stays on the host until a clip needs it."""
        if not self._vae_here:
            self.vae.to(self.device)
            self._vae_here = True
        return self.vae

    def release_vae(self) -> None:
        """The video VAE off the device (to host memory) before the text encoder comes back to it: the two stages
        never hold the device together (`infra.models.memory`)."""
        with self._lock:
            if self._vae_here and self.device.type != "cpu":
                self.vae.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._vae_here = self.device.type == "cpu" and self._vae_here

    # ------------------------------------------------------------------------------------------------ video

    def _pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[-1, 1] pixels of a uint8-valued resize (``x / 127.5 - 1``) → the VAE's input: the uint8 values back
        (exact), ``/ 255``, ImageNet-normalised, float32 on the device."""
        values = ((pixels.float() + 1.0) * 127.5).round()
        x = values.to(self.device).div_(255.0)
        return (x - self.pixel_mean.to(self.device)) / self.pixel_std.to(self.device)

    @torch.inference_mode()
    def _posteriors(self, pixels: Sequence[torch.Tensor]) -> Any:
        with self._lock:
            return self._on_device().encode(torch.cat([self._pixels(p) for p in pixels])).latent_dist

    def _normalised(self, z: torch.Tensor) -> list[torch.Tensor]:
        normed = (z.float().cpu() - self.mean) / self.std
        return [row.contiguous() for row in normed]

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encode_videos([pixels])[0]

    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The normalised posterior means, float32 (one VAE call for the batch)."""
        return self._normalised(self._posteriors(pixels).mean)

    def encode_sampled_videos(self, pixels: Sequence[torch.Tensor], seed: int = SAMPLE_SEED) -> list[torch.Tensor]:
        """Normalised posterior samples, float32: each clip's ``mean + std · ε``, ε drawn on the CPU from a
        generator seeded `seed` for that clip alone (FastVideo's ``posterior.sample(torch.Generator("cpu")
        .manual_seed(42))`` of one clip), whatever the batch."""
        posterior = self._posteriors(pixels)
        rows = []
        for mean, std in zip(posterior.mean, posterior.std, strict=True):
            noise = torch.randn((1, *mean.shape), generator=torch.Generator("cpu").manual_seed(seed))
            rows.append(mean[None] + std[None] * noise.to(mean.device, mean.dtype))
        return self._normalised(torch.cat(rows))

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.float().unsqueeze(0) * self.std + self.mean
        with self._lock:
            sample = self._on_device().decode(z.to(self.device)).sample.float().cpu()
        pixels = (sample * self.pixel_std + self.pixel_mean).clamp(0, 1)
        return pixels[0] * 2 - 1

    # ------------------------------------------------------------------------------------------------ text

    def load_text_encoder(self) -> torch.nn.Module:
        return load_conditioner(self.model_dir, self.device, self.dtype, self.text_8bit)

    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        return self.encode_texts([prompt], settings)[0]

    @torch.inference_mode()
    def encode_texts(self, prompts: Sequence[str], settings: TextSettings) -> list[TextEmbedding]:
        """Each prompt alone (as the pipelines encode one presentation a call: no padding reaches the
        conditioner), ``hidden_states[50]``, zero rows past its tokens up to max_length."""
        with TOKENIZER_LOCK:
            rows = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        made = []
        for ids in rows:
            kept = ids[: settings.max_length]
            hidden = self._conditioning(kept) if kept else torch.zeros(0, self._width())
            embeds = torch.zeros(settings.max_length, hidden.shape[-1], dtype=torch.float32)
            embeds[: len(kept)] = hidden.float().cpu()
            made.append(TextEmbedding(embeds, len(kept), len(ids)))
        return made

    def _width(self) -> int:
        return int(self.text_encoder.config.text_config.hidden_size)

    def _conditioning(self, ids: list[int]) -> torch.Tensor:
        """diffusers' ``get_qwen3vl_prompt_embeds`` of a text-only presentation: the conditioner's language model
        over the ids with an all-ones mask and text-only token types, ``hidden_states[50]`` in its dtype."""
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        with self._lock:
            out = self.text_encoder.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=torch.zeros_like(input_ids),
                use_cache=False,
                output_hidden_states=True,
            )
            return out.hidden_states[TEXT_LAYER][0]

    # ------------------------------------------------------------------------------------------------ audio

    def _audio(self) -> Any:
        if self._audio_vae is None:
            from diffusers import AutoencoderKLMiniMaxH3Audio  # noqa: PLC0415 - heavy: diffusers, only when needed

            path = self.model_dir / "audio_vae"
            if not path.is_dir():
                raise ConfigError(f"{self.model_dir}: no audio_vae/ (needed for --audio)")
            vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
            self._audio_vae = vae.to(self.device).eval()
        return self._audio_vae

    def audio_rate(self) -> int:
        """The audio VAE's sampling rate (32 kHz as released)."""
        return int(read_json(self.model_dir / "audio_vae" / "config.json").get("sampling_rate", 32000))

    def stereo(self, media: bytes, seconds: float, pad: bool = True) -> Waveform | None:
        """The clip's track as H3 takes it: `seconds` long (trimmed; zero-padded when short unless not `pad`),
        stereo, at the audio VAE's rate. None without an audio stream."""
        wave = decode_audio(media, max_seconds=seconds)
        if wave is None:
            return None
        if pad:
            wave = fit_duration(wave, seconds)
        samples = wave.samples.repeat(AUDIO_CHANNELS, 1) if wave.channels == 1 else wave.samples[:AUDIO_CHANNELS]
        return resample(Waveform(samples.contiguous(), wave.rate), self.audio_rate())

    @torch.inference_mode()
    def encode_audio(self, media: bytes, seconds: float, pad: bool = True) -> AudioEmbedding | None:
        wave = self.stereo(media, seconds, pad)
        if wave is None:
            return None
        if wave.samples.shape[-1] == 0:
            raise InputError("audio_too_short", "the audio track keeps 0 samples")
        with self._lock:
            vae = self._audio()
            z = vae.encode(wave.samples[:, None].to(self.device, torch.float32)).latent_dist.mode().float().cpu()
            mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1) for v in _stats(vae))
        return AudioEmbedding(((z - mean) / std).contiguous(), self.audio_mels(wave), wave.seconds)

    def audio_reference(self, media: bytes, seconds: float) -> torch.Tensor | None:
        """The log-mel [2, T, 64] of the clip's track as it was encoded (decode-and-verify's reference)."""
        wave = self.stereo(media, seconds)
        return None if wave is None else self.audio_mels(wave)

    def audio_mels(self, wave: Waveform) -> torch.Tensor:
        """Per channel: the log-mel [C, T, 64] of a waveform at the audio VAE's rate."""
        return log_mel(wave, hop_length=round(wave.rate * MEL_HOP_SECONDS))

    @torch.inference_mode()
    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Stored [2, 32, T] → the decoded stereo waveform's log-mel, per channel [2, T', 64]."""
        with self._lock:
            vae = self._audio()
            mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1) for v in _stats(vae))
            z = latents.float() * std + mean
            audio = vae.decode(z.to(self.device, torch.float32)).sample.float().cpu()
        return self.audio_mels(Waveform(audio.reshape(AUDIO_CHANNELS, -1).contiguous(), self.audio_rate()))


def _stats(vae: Any) -> tuple[list[float], list[float]]:
    channels = int(vae.config.latent_channels)
    return list(vae.config.latents_mean or [0.0] * channels), list(vae.config.latents_std or [1.0] * channels)


def load_conditioner(model_dir: Path, device: torch.device, dtype: torch.dtype, in_8bit: bool = False) -> Any:
    """The snapshot's Qwen3-VL conditioner on `device`, eval mode, with only the decoder layers ``hidden_states[50]``
    depends on (layers past the 51st change nothing before them: fewer weights, the same numbers); `in_8bit`:
    bitsandbytes' LLM.int8() as it loads (CUDA only)."""
    import transformers  # noqa: PLC0415 - heavy import, only when loading

    path = model_dir / "text_encoder"
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    layers = int(config.text_config.num_hidden_layers)
    if layers <= TEXT_LAYER:
        raise ConfigError(
            f"{path}: {layers} decoder layers; MiniMax-H3 reads hidden_states[{TEXT_LAYER}] before the final norm, "
            f"which needs more than {TEXT_LAYER}"
        )
    config.text_config.num_hidden_layers = TEXT_LAYER + 1
    model_class = transformers.Qwen3VLForConditionalGeneration
    if not in_8bit:
        model = model_class.from_pretrained(path, config=config, torch_dtype=dtype, local_files_only=True)
        return model.to(device).eval()
    if device.type != "cuda":
        raise ConfigError(f"--load-text-encoder-in-8bit: bitsandbytes' 8-bit Qwen3-VL runs on CUDA, not {device}")
    model = model_class.from_pretrained(
        path,
        config=config,
        torch_dtype=dtype,
        quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True),
        device_map={"": torch.cuda.current_device() if device.index is None else device.index},
        local_files_only=True,
    )
    return model.eval()
