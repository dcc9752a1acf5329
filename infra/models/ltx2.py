"""LTX-2 (diffusers' LTX-2 layout: 2.0, 2.3 and 2.5) from a local snapshot: the video VAE, the Gemma text encoder
(Gemma 3; Gemma 4 for LTX-2.5) and the text connectors, and the audio VAE for an audio run. What is cached is what
the LTX-2 trainer's ``process_dataset.py`` caches:

* video: the posterior **mean**, normalised as ``LTX2Pipeline`` does: ``(z - latents_mean) * scaling_factor /
  latents_std``, bf16 ``[128, F', H', W']``;
* text: Gemma with left padding to 1024 tokens, a ``<bos>`` first (ltx-core's ``LTXGemmaTokenizer`` prepends it
  where the tokenizer does not: Gemma 4's), every hidden state (embeddings and each layer) stacked, then the
  connectors' own per-layer masked normalisation and ``text_proj_in``: the **pre-connector** tensor (the
  connectors' transformers run at training time), bf16 ``[1024, D]``, with the int64 attention mask (left
  padding, 1 = real) and the audio prompt embedding (the same tensor for LTX-2.0). ``post_connector`` stores the
  connectors' outputs instead (FastVideo's overfit parquet), with the all-ones mask they return;
* audio: `infra.media.audio.trainer_audio` (trimmed or padded to F / fps seconds, the trainer's stereo downmix,
  16 kHz, log-mel) → the audio VAE's mean, normalised over the packed ``C·M`` axis as ``LTX2Pipeline`` does,
  float32 ``[8, T', 16]``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.errors import ConfigError
from infra.media.audio import trainer_audio
from infra.models import ltx2_modes
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
from infra.models.ltx2_text import UNRECORDED_VERSIONS, load_gemma, ltx2_version, trainer_tokens

logger = logging.getLogger(__name__)

STORE_DTYPE = torch.bfloat16
PAD_SIDE = "left"
NORM_SCALE = 8  # LTX-2.0's per-layer masked mean/range normalisation scale


class Ltx2Spec(FamilySpec):
    """Detection, constraints and loading for the ltx2 family."""

    name = "ltx2"
    components = ("vae", "text_encoder", "tokenizer", "connectors")
    latent_norm = "(posterior.mean - latents_mean) * scaling_factor / latents_std, fp32"
    defaults: ClassVar[dict[str, Any]] = {
        "temporal": "head",
        "resize": "cover-crop",
        "text_max_length": 1024,
        "text_stage": "pre_connector",
    }
    text_stages = ("pre_connector", "post_connector")
    has_audio = True
    text_trimmable = False  # left padding; the pre-connector pad rows are the projection's bias, not zeros
    text_8bit = True
    mode_roles: ClassVar[dict[str, tuple[str, ...]]] = ltx2_modes.MODE_ROLES

    def check(self, encoding: Any) -> None:
        ltx2_modes.check(encoding)

    def components_for(self, audio: bool) -> tuple[str, ...]:
        return (*self.components, "audio_vae") if audio else self.components

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae") or [None, None]
        return vae[-1] == "AutoencoderKLLTX2Video"

    def _vae(self, model_dir: Path) -> dict[str, Any]:
        return read_json(model_dir / "vae" / "config.json")

    def rules(self, model_dir: Path) -> GeometryRules:
        cfg = self._vae(model_dir)
        return GeometryRules(
            frame_multiple=int(cfg.get("temporal_compression_ratio", 8)),
            frame_remainder=1,
            spatial_multiple=int(cfg.get("spatial_compression_ratio", 32)),
        )

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = self._vae(model_dir)
        t, s = int(cfg.get("temporal_compression_ratio", 8)), int(cfg.get("spatial_compression_ratio", 32))
        return (int(cfg.get("latent_channels", 128)), 1 + (frames - 1) // t, height // s, width // s)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        cfg = read_json(model_dir / "connectors" / "config.json")
        if settings.stage == "post_connector":
            width = int(cfg["video_connector_num_attention_heads"]) * int(cfg["video_connector_attention_head_dim"])
        elif cfg.get("per_modality_projections"):
            width = int(cfg["video_hidden_dim"])
        else:
            width = int(cfg["caption_channels"])
        return (settings.max_length, width)

    def model_version(self, model_dir: Path) -> str | None:
        version = ltx2_version(model_dir)
        return None if version in UNRECORDED_VERSIONS else version

    def load(
        self, model_dir: Path, device: torch.device, dtype: torch.dtype, text_encoder_8bit: bool = False
    ) -> Ltx2Encoder:
        return Ltx2Encoder(model_dir, device, dtype, text_encoder_8bit)


class Ltx2Encoder(LoadedFamily):
    """Loaded video VAE, Gemma (3 or 4), tokenizer and connectors; the audio VAE loads on first use. Calls are
    serialised (shards run in threads; the models keep state while they run). ``text_8bit``: Gemma loaded in 8-bit
    by bitsandbytes (CUDA only)."""

    name = "ltx2"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, text_8bit: bool = False) -> None:
        from diffusers import AutoencoderKLLTX2Video  # noqa: PLC0415 - heavy imports, only when loading
        from diffusers.pipelines.ltx2 import LTX2TextConnectors  # noqa: PLC0415
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.model_dir, self.device, self.dtype, self.text_8bit = model_dir, device, dtype, text_8bit
        self.version = ltx2_version(model_dir)
        self.vae = AutoencoderKLLTX2Video.from_pretrained(model_dir / "vae", torch_dtype=dtype, local_files_only=True)
        self.vae.to(device).eval()
        self.text_encoder = self.load_text_encoder()
        self.connectors = LTX2TextConnectors.from_pretrained(
            model_dir / "connectors", torch_dtype=dtype, local_files_only=True
        )
        self.connectors.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
        self.tokenizer.padding_side = PAD_SIDE
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.mean = self.vae.latents_mean.float().cpu().view(1, -1, 1, 1, 1)
        self.std = self.vae.latents_std.float().cpu().view(1, -1, 1, 1, 1)
        self.scale = float(self.vae.config.scaling_factor)
        self._audio_vae: Any = None
        self._lock = threading.Lock()
        logger.info(
            "loaded ltx2 %s from %s on %s (%s%s)", self.version, model_dir, device, dtype, text_8bit * ", 8-bit text"
        )

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encode_videos([pixels])[0]

    @torch.inference_mode()
    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One VAE call for the batch (clips of one bucket)."""
        with self._lock:
            z = self.vae.encode(torch.cat([p.to(self.device, self.dtype) for p in pixels])).latent_dist.mean
        normed = ((z.float().cpu() - self.mean) * self.scale / self.std).to(STORE_DTYPE)
        return [row.contiguous() for row in normed]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.float().unsqueeze(0) * self.std / self.scale + self.mean
        with self._lock:
            pixels = self.vae.decode(z.to(self.device, self.dtype)).sample
        return pixels.float().cpu()[0].clamp(-1, 1)

    def load_text_encoder(self) -> torch.nn.Module:
        return load_gemma(self.model_dir, self.device, self.dtype, self.text_8bit)

    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        return self.encode_texts([prompt], settings)[0]

    @torch.inference_mode()
    def encode_texts(self, prompts: Sequence[str], settings: TextSettings) -> list[TextEmbedding]:
        """One Gemma (and connectors) call for every prompt, each left-padded to max_length on its own."""
        from diffusers.pipelines.ltx2.connectors import per_layer_masked_mean_norm  # noqa: PLC0415 - heavy: diffusers

        with TOKENIZER_LOCK:  # the tokenizer's padding and truncation are shared state
            tokens, totals = trainer_tokens(self.tokenizer, prompts, settings.max_length)
        mask = tokens.attention_mask
        with self._lock:
            out = self.text_encoder(
                input_ids=tokens.input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                output_hidden_states=True,
            )
            stacked = torch.stack(out.hidden_states, dim=-1).to(self.dtype)  # [B, L, D, layers + 1]
            if settings.stage == "post_connector":
                video, audio, kept = self.connectors(stacked.flatten(2, 3), mask.to(self.device), padding_side=PAD_SIDE)
                mask_out = kept.to(torch.int64).cpu()
            else:
                video, audio = self._pre_connector(stacked, mask.to(self.device), per_layer_masked_mean_norm)
                mask_out = mask.to(torch.int64)
        result = []
        for row, total in enumerate(totals):
            embeds = video[row].float().cpu().to(STORE_DTYPE).contiguous()
            extras = {
                "prompt_attention_mask": mask_out[row].contiguous(),
                "audio_prompt_embeds": audio[row].float().cpu().to(STORE_DTYPE).contiguous(),
            }
            result.append(TextEmbedding(embeds, int(mask[row].sum()), total, extras))
        return result

    def _pre_connector(self, stacked: torch.Tensor, mask: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """What the connectors' own forward feeds their transformers (LTX-2.0: one projection for both streams;
        LTX-2.3 and 2.5: one per modality, after a per-token RMS norm, as `LTX2TextConnectors.forward` computes
        them; ltx-core's ``FeatureExtractorV2``)."""
        cfg = self.connectors.config
        if not cfg.per_modality_projections:
            normed = norm(
                stacked, mask.sum(dim=-1), device=stacked.device, padding_side=PAD_SIDE, scale_factor=NORM_SCALE
            )
            projected = self.connectors.text_proj_in(normed)
            return projected, projected
        from diffusers.pipelines.ltx2.connectors import per_token_rms_norm  # noqa: PLC0415 - heavy: diffusers

        flat = per_token_rms_norm(stacked).flatten(2, 3)
        flat = torch.where(mask.bool().unsqueeze(-1), flat, torch.zeros_like(flat))
        video = self.connectors.video_text_proj_in(flat * (cfg.video_hidden_dim / cfg.caption_channels) ** 0.5)
        audio = self.connectors.audio_text_proj_in(flat * (cfg.audio_hidden_dim / cfg.caption_channels) ** 0.5)
        return video, audio

    def _audio(self) -> Any:
        if self._audio_vae is None:
            from diffusers import AutoencoderKLLTX2Audio  # noqa: PLC0415 - heavy: diffusers, only when loading

            path = self.model_dir / "audio_vae"
            if not path.is_dir():
                raise ConfigError(f"{self.model_dir}: no audio_vae/ (needed for --audio)")
            vae = AutoencoderKLLTX2Audio.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
            self._audio_vae = vae.to(self.device).eval()  # float32, as the trainer runs it
        return self._audio_vae

    @torch.inference_mode()
    def encode_audio(self, media: bytes, seconds: float, pad: bool = True) -> AudioEmbedding | None:
        prepared = trainer_audio(media, seconds, pad)
        if prepared is None:
            return None
        mel, duration = prepared
        with self._lock:
            vae = self._audio()
            z = vae.encode(mel.unsqueeze(0).to(self.device, torch.float32)).latent_dist.mean.float().cpu()
            mean, std = vae.latents_mean.float().cpu(), vae.latents_std.float().cpu()
        _, channels, _, bins = z.shape
        packed = z.transpose(1, 2).flatten(2, 3)  # [1, T', C·M]: the order LTX2Pipeline normalises in
        normed = ((packed - mean) / std).unflatten(2, (channels, bins)).transpose(1, 2)
        return AudioEmbedding(normed[0].contiguous(), mel, duration)

    @torch.inference_mode()
    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        with self._lock:
            vae = self._audio()
            mean, std = vae.latents_mean.float().cpu(), vae.latents_std.float().cpu()
            channels, _, bins = latents.shape
            packed = latents.float().unsqueeze(0).transpose(1, 2).flatten(2, 3) * std + mean
            z = packed.unflatten(2, (channels, bins)).transpose(1, 2)
            mel = vae.decode(z.to(self.device, torch.float32)).sample
        return mel.float().cpu()[0]
