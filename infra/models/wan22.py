"""Wan2.2 (TI2V-5B VAE, z_dim 48) with the UMT5 text encoder, loaded from a local diffusers snapshot."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from infra.errors import ConfigError
from infra.media.text_clean import clean
from infra.models.base import (
    TOKENIZER_LOCK,
    FamilySpec,
    GeometryRules,
    ImageConditioning,
    LoadedFamily,
    TextEmbedding,
    TextSettings,
    read_json,
)
from infra.models.wan_decode import DECODE_CHUNK, decode_video, pixel_spans

logger = logging.getLogger(__name__)

STORE_DTYPE = torch.bfloat16
#: The TI2V-5B VAE's latent channels (the Wan2.1 VAE's are 16: `infra.models.wan21`).
Z_DIM = 48
#: What the spec's ``conditioning`` says a TI2V-5B ``--mode i2v`` cache stores: DiffSynth's ``first_frame_latents``
#: (``WanVideoUnit_ImageEmbedderFused`` encodes the first frame alone; the causal VAE gives the same latent frame).
FIRST_FRAME_RECIPE = "first_frame_latents: the first latent frame of the normalised latents"
#: diffusers' logger that warns about config keys a class does not take.
DIFFUSERS_CONFIG_LOGGER = "diffusers.configuration_utils"


class _IgnoredClipOutput(logging.Filter):
    """Drops diffusers' warning that ``clip_output`` is not expected: the published Wan2.2 ``vae/config.json``
    (and so the tiny model, made like it) holds that key of the conversion script, which AutoencoderKLWan does
    not take and ignores (`infra.models.wan_constants`). Any other unexpected key is still warned about."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "{'clip_output': False} were passed to AutoencoderKLWan" not in message


@contextlib.contextmanager
def _known_attribute_ignored() -> Iterator[None]:
    """The VAE's load without the warning about the published config's ``clip_output`` (only that one)."""
    target = logging.getLogger(DIFFUSERS_CONFIG_LOGGER)
    quiet = _IgnoredClipOutput()
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


class Wan22Spec(FamilySpec):
    """Detection, constraints and loading for the wan22 family."""

    name = "wan22"
    components = ("vae", "text_encoder", "tokenizer")
    latent_norm = "(posterior.mode - latents_mean) / latents_std, fp32"  # parquet: consumers.RAW_MEAN
    takes_image = True

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae") or [None, None]
        return vae[-1] == "AutoencoderKLWan" and read_json(model_dir / "vae" / "config.json").get("z_dim") == Z_DIM

    def rules(self, model_dir: Path) -> GeometryRules:
        """The VAE's factors; ConfigError for another VAE than the TI2V-5B's (a Wan2.1 snapshot named family wan22,
        by --family or a recipe)."""
        cfg = read_json(model_dir / "vae" / "config.json")
        if cfg.get("z_dim") != Z_DIM:
            raise ConfigError(
                f"{model_dir}: AutoencoderKLWan with z_dim={cfg.get('z_dim')} is the Wan2.1 VAE (Wan2.1, Wan2.2-A14B: "
                f"family wan21); family wan22 is the Wan2.2-TI2V-5B VAE with z_dim={Z_DIM}"
            )
        return GeometryRules(
            frame_multiple=int(cfg.get("scale_factor_temporal", 4)),
            frame_remainder=1,
            spatial_multiple=int(cfg.get("scale_factor_spatial", 16)),
        )

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = read_json(model_dir / "vae" / "config.json")
        t, s = int(cfg.get("scale_factor_temporal", 4)), int(cfg.get("scale_factor_spatial", 16))
        return (int(cfg["z_dim"]), 1 + (frames - 1) // t, height // s, width // s)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        return (settings.max_length, int(read_json(model_dir / "text_encoder" / "config.json")["d_model"]))

    def kinds(self, spec: Any) -> tuple[str, ...]:
        if getattr(spec, "mode", "t2v") == "i2v":  # TI2V-5B: the first latent frame, which it keeps clean
            return (*self.output_kinds, "first_frame_latents")
        return super().kinds(spec)

    def conditioning(self, model_dir: Path, mode: str) -> str | None:
        return FIRST_FRAME_RECIPE if mode == "i2v" else None

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Wan22Encoder:
        return Wan22Encoder(model_dir, device, dtype)


class Wan22Encoder(LoadedFamily):
    """Loaded VAE + UMT5 + tokenizer. The Wan VAE keeps a feature cache on itself while it encodes,
    so every call holds a lock: shards run in parallel threads, model calls one at a time."""

    name = "wan22"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from diffusers import AutoencoderKLWan  # noqa: PLC0415 - heavy import, only when loading
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        with _known_attribute_ignored():
            self.vae = AutoencoderKLWan.from_pretrained(model_dir / "vae", torch_dtype=dtype, local_files_only=True)
        self.vae.to(device).eval()
        self.text_encoder = self.load_text_encoder().to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
        channels = self.vae.config.z_dim
        self.mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32).view(1, channels, 1, 1, 1)
        self.std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, channels, 1, 1, 1)
        self._lock = threading.Lock()
        logger.info("loaded %s from %s on %s (%s)", self.name, model_dir, device, dtype)

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encode_videos([pixels])[0]

    @torch.inference_mode()
    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One VAE call for the batch (clips of one shape): the Wan VAE's causal feature cache is per batch row."""
        normed = ((self._posterior_mean(pixels) - self.mean) / self.std).to(STORE_DTYPE)
        return [row.contiguous() for row in normed]

    @torch.inference_mode()
    def encode_raw_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The raw posterior mean, float32 (the caller casts it to the stored dtype): what FastVideo's Wan
        preprocessing stores; its WanModel normalises at training time (`infra.formats.consumers`)."""
        return [row.contiguous() for row in self._posterior_mean(pixels)]

    def _posterior_mean(self, pixels: Sequence[torch.Tensor]) -> torch.Tensor:
        with self._lock:  # mode() is the mean of the diagonal Gaussian posterior
            z = self.vae.encode(torch.cat([p.to(self.device, self.dtype) for p in pixels])).latent_dist.mode()
        return z.float().cpu()

    def encode_conditioning(self, pixels: torch.Tensor, latents: torch.Tensor) -> ImageConditioning:
        """TI2V-5B: the first latent frame of the stored latents."""
        return ImageConditioning(first_frame_latents=latents[:, :1].clone())

    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw posterior means (C, F', H', W') → the stored normalisation `decode` takes, float32."""
        return ((raw.float().unsqueeze(0) - self.mean) / self.std)[0]

    def load_text_encoder(self) -> torch.nn.Module:
        from transformers import UMT5EncoderModel  # noqa: PLC0415 - heavy import, only when loading

        path = self.model_dir / "text_encoder"
        return UMT5EncoderModel.from_pretrained(path, torch_dtype=self.dtype, local_files_only=True).eval()

    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        return self.encode_texts([prompt], settings)[0]

    @torch.inference_mode()
    def encode_texts(self, prompts: Sequence[str], settings: TextSettings) -> list[TextEmbedding]:
        """One UMT5 call for every prompt: each is padded to max_length on its own, so a row's numbers do not depend
        on the others in the batch (tests/test_text_batch.py holds that bit for bit)."""
        prompts = [clean(prompt, settings.clean) for prompt in prompts]  # as the consumer's tokenizer reads them
        with TOKENIZER_LOCK:  # a fast tokenizer's padding and truncation are its backend's state, shared by threads
            tokens = self.tokenizer(
                prompts,
                padding="max_length",
                max_length=settings.max_length,
                truncation=True,
                add_special_tokens=True,
                return_attention_mask=True,
                return_tensors="pt",
            )
            untruncated = self.tokenizer(prompts, add_special_tokens=True, truncation=False).input_ids
        lengths = tokens.attention_mask.gt(0).sum(dim=1).tolist()
        totals = [len(ids) for ids in untruncated]
        with self._lock:
            out = self.text_encoder(
                tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
            ).last_hidden_state
        result = []
        for row, (seq_len, total) in enumerate(zip(lengths, totals, strict=True)):
            embeds = out[row].float().cpu()
            if settings.padding == "zeros":
                embeds[seq_len:] = 0  # as WanPipeline._get_t5_prompt_embeds feeds the transformer
            result.append(TextEmbedding(embeds.to(STORE_DTYPE).contiguous(), int(seq_len), total))
        return result

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.float().unsqueeze(0) * self.std + self.mean
        with self._lock:
            pixels = self.vae.decode(z.to(self.device, self.dtype)).sample
        return pixels.float().cpu()[0].clamp(-1, 1)

    @torch.inference_mode()
    def decode_chunks(self, latents: torch.Tensor, chunk: int = DECODE_CHUNK) -> Iterator[torch.Tensor]:
        """`decode`'s pixels bit for bit (spatially tiled for a frame over `WHOLE_DECODE_MAX_AREA`:
        `infra.models.wan_decode`), moved to the CPU as float32 `chunk` latent frames' worth at a time."""
        z = latents.float().unsqueeze(0) * self.std + self.mean
        with self._lock:
            pixels = decode_video(self.vae, z.to(self.device, self.dtype))
        for start, end in pixel_spans(latents.shape[1], chunk, self.vae.config.scale_factor_temporal):
            yield pixels[:, :, start:end].float().cpu()[0].clamp(-1, 1)
