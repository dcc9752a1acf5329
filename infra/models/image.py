"""The image family: a diffusers image VAE (``AutoencoderKL`` or ``AutoencoderDC``), optionally a CLIP or T5 text
encoder, from a local diffusers directory (``model_index.json`` + ``vae/`` [+ ``text_encoder/`` + ``tokenizer/``])
or a bare VAE folder (``config.json`` + weights).

Latents are stored per image as ``(C, H/r, W/r)`` (no frame axis; r the VAE's spatial compression), normalised
as diffusers pipelines do: AutoencoderKL ``(posterior.mode - shift_factor) * scaling_factor`` (shift 0 where the
config has none: SD1.x/SDXL; Flux and SD3 set it), AutoencoderDC ``latent * scaling_factor`` (Sana). `decode`
inverts it and returns ``(3, 1, H, W)``. Without ``text_encoder/`` the cache stores captions as text only and
has no ``text_embeddings`` output kind.
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

VAE_CLASSES = ("AutoencoderKL", "AutoencoderDC")
TEXT_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")
TEXT_KIND = "text_embeddings"


def vae_dir(model_dir: Path) -> Path:
    """``vae/`` of a diffusers directory, else the directory itself (a bare VAE folder)."""
    return model_dir / "vae" if (model_dir / "vae" / "config.json").is_file() else model_dir


def has_text(model_dir: Path) -> bool:
    """True when the directory has a text encoder and its tokenizer."""
    return (model_dir / "text_encoder" / "config.json").is_file() and (model_dir / "tokenizer").is_dir()


def _vae_config(model_dir: Path) -> dict[str, Any]:
    cfg = read_json(vae_dir(model_dir) / "config.json")
    if cfg.get("_class_name") not in VAE_CLASSES:
        raise ConfigError(
            f"{vae_dir(model_dir)}: the image family reads {' or '.join(VAE_CLASSES)}, not {cfg.get('_class_name')!r}"
        )
    return cfg


def spatial_ratio(cfg: dict[str, Any]) -> int:
    """The VAE's spatial compression: 2 ** (len(block_out_channels) - 1), as diffusers computes it."""
    key = "block_out_channels" if cfg["_class_name"] == "AutoencoderKL" else "encoder_block_out_channels"
    return 2 ** (len(cfg.get(key, (64,))) - 1)


class ImageSpec(FamilySpec):
    """Detection, constraints and loading for the image family."""

    name = "image"
    media = "image"
    components = ("vae", "text_encoder", "tokenizer")
    latent_norm = "AutoencoderKL: (posterior.mode - shift_factor) * scaling_factor; AutoencoderDC: z * scaling_factor"
    store_dtypes: ClassVar[tuple[str, ...]] = ("bf16", "fp16")
    #: torchvision: the CC12M seed's Resize(BICUBIC) + CenterCrop; cover-crop: latentforge's older arithmetic,
    #: kept so a cache made with it can be extended (`infra.media.image`).
    resize_policies: ClassVar[tuple[str, ...]] = ("torchvision", "cover-crop")
    defaults: ClassVar[dict[str, Any]] = {
        "temporal": "head",
        "resize": "torchvision",
        "text_max_length": 77,
        "text_stage": "last_hidden_state",
    }

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae") or [None, None]
        if vae[-1] in VAE_CLASSES:
            return True
        if index or not (model_dir / "config.json").is_file():
            return False
        return read_json(model_dir / "config.json").get("_class_name") in VAE_CLASSES

    def components_in(self, model_dir: Path, audio: bool = False) -> tuple[str, ...]:
        vae = "vae" if vae_dir(model_dir) != model_dir else "."
        return (vae, "text_encoder", "tokenizer") if has_text(model_dir) else (vae,)

    def kinds(self, spec: Any) -> tuple[str, ...]:
        return ("latents", TEXT_KIND) if "text_encoder" in spec.model_identity else ("latents",)

    def rules(self, model_dir: Path) -> GeometryRules:
        return GeometryRules(
            frame_multiple=1, frame_remainder=0, spatial_multiple=spatial_ratio(_vae_config(model_dir))
        )

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = _vae_config(model_dir)
        ratio = spatial_ratio(cfg)
        return (int(cfg.get("latent_channels", 4)), height // ratio, width // ratio)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        if not has_text(model_dir):
            return ()
        cfg = read_json(model_dir / "text_encoder" / "config.json")
        return (settings.max_length, int(cfg.get("hidden_size") or cfg["d_model"]))

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> ImageEncoder:
        return ImageEncoder(model_dir, device, dtype)


def normalise(z: torch.Tensor, scale: float, shift: float) -> torch.Tensor:
    """Raw VAE latents → the diffusion model's space, as diffusers pipelines do: (z - shift) * scale."""
    return (z - shift) * scale


def denormalise(latents: torch.Tensor, scale: float, shift: float) -> torch.Tensor:
    """The inverse of `normalise`: latents / scale + shift (what a pipeline feeds vae.decode)."""
    return latents / scale + shift


class ImageEncoder(LoadedFamily):
    """Loaded image VAE, and the text encoder + tokenizer where the directory has them. Calls hold a lock."""

    name = "image"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        import diffusers  # noqa: PLC0415 - heavy import, only when loading

        cfg = _vae_config(model_dir)
        self.kind = cfg["_class_name"]
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        vae_cls = getattr(diffusers, self.kind)
        self.vae = vae_cls.from_pretrained(vae_dir(model_dir), torch_dtype=dtype, local_files_only=True)
        self.vae.to(device).eval()
        self.scale = float(self.vae.config.scaling_factor)
        self.shift = float(getattr(self.vae.config, "shift_factor", None) or 0.0)
        self.text_encoder, self.tokenizer = (
            _load_text(model_dir, device, dtype) if has_text(model_dir) else (None, None)
        )
        self._lock = threading.Lock()
        logger.info("loaded image family (%s) from %s on %s (%s)", self.kind, model_dir, device, dtype)

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """(1, 3, 1, H, W) in [-1, 1] → (C, H/r, W/r) float32 normalised latents (the caller casts to store)."""
        return self.encode_videos([pixels])[0]

    @torch.inference_mode()
    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One VAE call for the batch (images of one size)."""
        images = torch.cat([p[:, :, 0].to(self.device, self.dtype) for p in pixels])
        with self._lock:
            encoded = self.vae.encode(images)
        z = encoded.latent_dist.mode() if self.kind == "AutoencoderKL" else encoded.latent
        return [row.contiguous() for row in normalise(z.float().cpu(), self.scale, self.shift)]

    def load_text_encoder(self) -> torch.nn.Module:
        if not has_text(self.model_dir):
            raise ConfigError("this image model has no text encoder: --text-offload has nothing to offload")
        return _load_text(self.model_dir, torch.device("cpu"), self.dtype)[0]

    @torch.inference_mode()
    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        if self.text_encoder is None or self.tokenizer is None:
            raise ConfigError("this image model has no text encoder: captions are stored as text only")
        with TOKENIZER_LOCK:
            tokens = self.tokenizer(
                [prompt], padding="max_length", max_length=settings.max_length, truncation=True, return_tensors="pt"
            )
            total = len(self.tokenizer(prompt, truncation=False).input_ids)
        mask = tokens.attention_mask
        seq_len = int(mask.gt(0).sum())
        with self._lock:
            out = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask.to(self.device))
        embeds = out.last_hidden_state[0].float().cpu()
        if settings.padding == "zeros":
            embeds[seq_len:] = 0
        return TextEmbedding(embeds.contiguous(), seq_len, total)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = denormalise(latents.float(), self.scale, self.shift).unsqueeze(0)
        with self._lock:
            pixels = self.vae.decode(z.to(self.device, self.dtype)).sample
        return pixels.float().cpu()[0].clamp(-1, 1).unsqueeze(1)


def _load_text(model_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    import transformers  # noqa: PLC0415 - heavy import, only when loading

    cfg = read_json(model_dir / "text_encoder" / "config.json")
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in TEXT_CLASSES:
        raise ConfigError(f"{model_dir / 'text_encoder'}: the image family reads {', '.join(TEXT_CLASSES)}, not {arch}")
    model = getattr(transformers, arch).from_pretrained(
        model_dir / "text_encoder", torch_dtype=dtype, local_files_only=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
    return model.to(device).eval(), tokenizer
