"""Qwen-Image (``Qwen/Qwen-Image``, diffusers ``QwenImagePipeline``): still images through ``AutoencoderKLQwenImage``
(a video-style causal VAE, 8x spatial, used on one frame), captions through Qwen2.5-VL with Qwen-Image's prompt
template, from a local diffusers snapshot.

* latents: the posterior's mode of the one-frame image, ``(C, 1, H/8, W/8)``, normalised as diffusers'
  ``QwenImagePipeline`` and musubi-tuner's ``encode_pixels_to_latents`` do it, in the VAE's dtype:
  ``(z - latents_mean) * (1.0 / latents_std)``, both statistics cast to the VAE's dtype first and the reciprocal
  taken in it. DiffSynth-Studio's ``QwenImageVAE`` takes the reciprocal in float32 and casts it: in bf16 a few
  channels' factors differ by one step (and its VAE's own bf16 arithmetic by about one step): docs/qwen-image.md;
* text: the caption in the template below, tokenized to at most ``max_length + DROP_INDEX`` tokens (truncated at the
  end), the text encoder's ``hidden_states[-1]``, its first ``DROP_INDEX`` (34) rows dropped: the template's system
  prompt and ``<|im_start|>user\\n``. What is left (the caption's tokens and the template's 5 closing ones) is the
  embedding, ``seq_len`` rows; rows past it are zeros (no pad token is encoded: one caption at a time, as DiffSynth
  encodes, and as musubi and diffusers keep the rows of each caption's own mask).

``Qwen/Qwen-Image-Edit`` (``QwenImageEditPipeline``) is told apart and refused: its captions are encoded with the
control image through the vision tower (another template, drop index 64) and its control latents are cached beside
the target's; latentforge does not make them yet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.errors import ConfigError
from infra.models.base import (
    TOKENIZER_LOCK,
    FamilySpec,
    GeometryRules,
    LoadedFamily,
    TextEmbedding,
    TextSettings,
    read_json,
)

logger = logging.getLogger(__name__)

PIPELINE = "QwenImagePipeline"
EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
VAE_CLASS = "AutoencoderKLQwenImage"
#: Qwen-Image's text-to-image prompt template and the number of its tokens before the caption (diffusers'
#: ``prompt_template_encode`` / ``prompt_template_encode_start_idx``; musubi's and DiffSynth's are the same).
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROP_INDEX = 34
#: Pixels per latent step across: the VAE's 8, times the transformer's 2x2 patch (diffusers, musubi and DiffSynth
#: all take sides that are multiples of 16).
SPATIAL_MULTIPLE = 16
#: The real ``vae/config.json`` of Qwen/Qwen-Image (musubi-tuner's ``qwen_image_utils.load_vae`` restates it).
QWEN_IMAGE_VAE_CONFIG: dict[str, Any] = {
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571,
        -0.7089,
        -0.9113,
        0.1075,
        -0.1745,
        0.9653,
        -0.1517,
        1.5508,
        0.4134,
        -0.0715,
        0.5517,
        -0.3632,
        -0.1922,
        -0.9497,
        0.2503,
        -0.2921,
    ],
    "latents_std": [
        2.8184,
        1.4541,
        2.3275,
        2.6558,
        1.2196,
        1.7708,
        2.6052,
        2.0743,
        3.2687,
        2.1526,
        2.8652,
        1.5579,
        1.6382,
        1.1253,
        2.8251,
        1.916,
    ],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}


def _index(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "model_index.json"
    return read_json(path) if path.exists() else {}


def _vae_config(model_dir: Path) -> dict[str, Any]:
    return read_json(Path(model_dir) / "vae" / "config.json")


def vae_ratio(cfg: dict[str, Any]) -> int:
    """The VAE's spatial compression, as diffusers computes it: 2 ** len(temperal_downsample)."""
    return 2 ** len(cfg.get("temperal_downsample", [False, True, True]))


class QwenImageSpec(FamilySpec):
    """Detection, constraints and loading for the qwen-image family."""

    name = "qwen-image"
    media = "image"
    components = ("vae", "text_encoder", "tokenizer")
    latent_norm = "(posterior.mode - latents_mean) * (1 / latents_std), in the VAE's dtype"
    store_dtypes: ClassVar[tuple[str, ...]] = ("bf16",)
    #: musubi-tuner's and DiffSynth-Studio's own arithmetic on the image (`infra.media.still`), or latentforge's
    #: cover-crop for a format no consumer of this family reads.
    resize_policies: ClassVar[tuple[str, ...]] = ("musubi", "diffsynth", "cover-crop")
    defaults: ClassVar[dict[str, Any]] = {
        "temporal": "head",
        "resize": "cover-crop",
        "text_max_length": 1024,  # diffusers' and musubi's tokenizer_max_length (DiffSynth's is 4096)
        "text_stage": "last_hidden_state",
    }

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae") or [None, None]
        return vae[-1] == VAE_CLASS and index.get("_class_name") in (PIPELINE, *EDIT_PIPELINES)

    def rules(self, model_dir: Path) -> GeometryRules:
        pipeline = _index(model_dir).get("_class_name")
        if pipeline in EDIT_PIPELINES:
            raise ConfigError(
                f"{model_dir} is a {pipeline} snapshot (Qwen-Image-Edit): its captions are encoded with the control "
                "image and its control latents cached beside the target's, which latentforge does not make yet; give "
                "the Qwen/Qwen-Image snapshot"
            )
        cfg = _vae_config(model_dir)
        if cfg.get("_class_name") != VAE_CLASS:
            raise ConfigError(f"{model_dir}/vae: family {self.name} reads {VAE_CLASS}, not {cfg.get('_class_name')}")
        return GeometryRules(frame_multiple=1, frame_remainder=0, spatial_multiple=SPATIAL_MULTIPLE)

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = _vae_config(model_dir)
        ratio = vae_ratio(cfg)
        return (int(cfg["z_dim"]), 1, height // ratio, width // ratio)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        cfg = read_json(Path(model_dir) / "text_encoder" / "config.json")
        hidden = (cfg.get("text_config") or {}).get("hidden_size") or cfg["hidden_size"]
        return (settings.max_length, int(hidden))

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> QwenImageEncoder:
        return QwenImageEncoder(model_dir, device, dtype)


def normalise(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Raw latents (B, C, F, H, W) → normalised, in their own dtype, as every Qwen-Image consumer does it."""
    shape = (1, len(mean), 1, 1, 1)
    mean_t = torch.tensor(mean).view(shape).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(std).view(shape).to(z.device, z.dtype)  # the reciprocal of the cast std, in the dtype
    return (z - mean_t) * inv_std


def denormalise(latents: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """The inverse of `normalise`, as diffusers' pipeline decodes: latents / (1 / latents_std) + latents_mean."""
    shape = (1, len(mean), 1, 1, 1)
    mean_t = torch.tensor(mean).view(shape).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(std).view(shape).to(latents.device, latents.dtype)
    return latents / inv_std + mean_t


class QwenImageEncoder(LoadedFamily):
    """Loaded VAE + Qwen2.5-VL + tokenizer; every model call holds a lock (the causal VAE keeps a feature cache on
    itself while it encodes)."""

    name = "qwen-image"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from diffusers import AutoencoderKLQwenImage  # noqa: PLC0415 - heavy import, only when loading
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.model_dir, self.device, self.dtype = Path(model_dir), device, dtype
        self.vae = AutoencoderKLQwenImage.from_pretrained(model_dir / "vae", torch_dtype=dtype, local_files_only=True)
        self.vae.to(device).eval()
        self.mean, self.std = list(self.vae.config.latents_mean), list(self.vae.config.latents_std)
        self.text_encoder = self.load_text_encoder().to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
        self._lock = threading.Lock()
        logger.info("loaded qwen-image from %s on %s (%s)", model_dir, device, dtype)

    def load_text_encoder(self) -> torch.nn.Module:
        from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: PLC0415 - heavy import

        path = self.model_dir / "text_encoder"
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, torch_dtype=self.dtype, local_files_only=True)
        # cast whole, buffers too, as musubi (``qwen2_5_vl.to(dtype)``) and DiffSynth (its model ``.to(torch_dtype)``)
        # do: the RoPE's inv_freq in the run's dtype (from_pretrained keeps it float32: other angles in bf16)
        return model.to(self.dtype).eval()

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encode_videos([pixels])[0]

    @torch.inference_mode()
    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Images (1, 3, 1, H, W) of one size → normalised latents (C, 1, H/8, W/8), bf16, in one VAE call."""
        x = torch.cat([p.to(self.device, self.dtype) for p in pixels])
        with self._lock:
            z = self.vae.encode(x).latent_dist.mode()
        normed = normalise(z, self.mean, self.std).to(torch.bfloat16).cpu()
        return [row.contiguous() for row in normed]

    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        """The caption in Qwen-Image's template → its rows past the drop index, zeros to ``max_length``."""
        text = TEMPLATE.format(prompt)
        with TOKENIZER_LOCK:
            tokens = self.tokenizer(
                [text], max_length=settings.max_length + DROP_INDEX, padding=True, truncation=True, return_tensors="pt"
            )
            total = len(self.tokenizer(text, truncation=False).input_ids) - DROP_INDEX
        with torch.inference_mode(), self._lock:
            out = self.text_encoder(
                input_ids=tokens.input_ids.to(self.device),
                attention_mask=tokens.attention_mask.to(self.device),
                output_hidden_states=True,
            )
        rows = out.hidden_states[-1][0][DROP_INDEX:].to(torch.bfloat16).cpu()
        embeds = torch.zeros((settings.max_length, rows.shape[1]), dtype=torch.bfloat16)
        embeds[: rows.shape[0]] = rows
        return TextEmbedding(embeds, int(rows.shape[0]), total)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Stored latents (C, 1, h, w) → pixels (3, 1, H, W) float32 in [-1, 1]."""
        z = denormalise(latents.to(self.device, self.dtype).unsqueeze(0), self.mean, self.std)
        with self._lock:
            pixels = self.vae.decode(z).sample
        return pixels.float().cpu()[0].clamp(-1, 1)
