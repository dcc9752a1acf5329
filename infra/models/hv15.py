"""HunyuanVideo 1.5 (``hv15``): the ``AutoencoderKLHunyuanVideo15`` VAE (32 channels, 16x spatial, 4x temporal) with
the Qwen2.5-VL text encoder and the ByT5 glyph encoder, loaded from a local diffusers snapshot
(``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`` and its siblings), told from ``model_index.json``
(``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline``).

What it stores is what musubi-tuner's caching scripts make (its ``hv_1_5_cache_latents.py`` and
``hv_1_5_cache_text_encoder_outputs.py`` at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7; the one consumer that
caches this family, `infra.formats.consumers`): the latents are the raw posterior mode, under autocast in the VAE's
dtype, one clip per VAE call, not scaled (its trainer multiplies by the VAE's ``scaling_factor``, 1.03682, when it
reads them); ``--vae-tiling`` is its ``--vae_sample_size 128`` (128-pixel tiles, a quarter overlapping, blended); the
text is `infra.models.hv15_text`'s.

An image-to-video snapshot (``HunyuanVideo15ImageToVideoPipeline``, its ``image_encoder/``) takes ``--mode i2v``:
each sample also stores musubi's ``--i2v`` conditioning (``hv_1_5_cache_latents.encode_and_save_batch``): the first
frame encoded alone by the VAE in latent frame 0 of a zero tensor shaped like the latents, then one mask channel (1 on
latent frame 0), ``[33, F', H', W']``; and the SigLIP image encoder's ``last_hidden_state`` of the first uint8 frame
(``frame_pack.clip_vision.hf_clip_vision_encode``: its fixed ``SiglipImageProcessor`` config, the encoder in float16).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.errors import ConfigError
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
from infra.models.hv15_text import (
    GLYPH_DTYPE,
    GLYPH_MAX_LENGTH,
    HIDDEN_STATE,
    MAX_LENGTH,
    PROMPT_TEMPLATE,
    TEXT_STAGE,
    autocast,
    crop_start,
    glyph_text,
)

logger = logging.getLogger(__name__)

I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
PIPELINES = ("HunyuanVideo15Pipeline", I2V_PIPELINE)
VAE_CLASS = "AutoencoderKLHunyuanVideo15"
#: The output kind of the glyph encoder's rows (`infra.formats.base.GLYPH_KIND`).
GLYPH_KIND = "glyph_embeddings"
#: musubi's hv_1_5_cache_latents.py ``--vae_sample_size`` default: the tile (pixels) of ``--vae-tiling``.
TILE = 128
TILE_OVERLAP = 0.25
#: What the spec's ``conditioning`` says an i2v cache stores.
I2V_RECIPE = (
    "latents_image: the first frame's VAE mode alone in latent frame 0 of zeros, then a mask channel (1 on frame 0); "
    "siglip: the image encoder's last_hidden_state of the first frame (musubi's SiglipImageProcessor, float16)"
)
#: musubi's ``frame_pack.framepack_utils.FEATURE_EXTRACTOR_CONFIG`` (the processor it builds for SigLIP).
SIGLIP_PROCESSOR = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"height": 384, "width": 384},
}
#: The image-to-video kinds: musubi's ``latents_image`` and ``siglip`` (`infra.formats.base`'s names).
I2V_KINDS = ("image_latents", "clip_features")


class Hv15Spec(FamilySpec):
    """Detection, constraints and loading for the hv15 family."""

    name = "hv15"
    components = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    latent_norm = "posterior.mode, raw: the trainer multiplies by vae.config.scaling_factor (1.03682)"
    output_kinds = ("latents", "text_embeddings", GLYPH_KIND)
    defaults: ClassVar[dict[str, Any]] = {
        **FamilySpec.defaults,
        "text_max_length": MAX_LENGTH,
        "text_stage": TEXT_STAGE,
    }
    text_stages = (TEXT_STAGE,)
    store_dtypes = ("bf16", "fp16")
    takes_image = True

    def components_in(self, model_dir: Path, audio: bool = False) -> tuple[str, ...]:
        index = _index(model_dir)
        return self.components + (("image_encoder",) if (index.get("image_encoder") or [None])[-1] else ())

    def kinds(self, spec: Any) -> tuple[str, ...]:
        return (*self.output_kinds, *I2V_KINDS) if getattr(spec, "mode", "t2v") == "i2v" else self.output_kinds

    def conditioning(self, model_dir: Path, mode: str) -> str | None:
        if mode != "i2v":
            return None
        index = _index(model_dir)
        if index.get("_class_name") != I2V_PIPELINE or not (Path(model_dir) / "image_encoder").is_dir():
            raise ConfigError(
                f"--mode i2v: {model_dir} is not a HunyuanVideo 1.5 image-to-video snapshot ({I2V_PIPELINE} with an "
                "image_encoder/): its transformer takes no image conditioning"
            )
        return I2V_RECIPE

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae") or [None, None]
        return index.get("_class_name") in PIPELINES or vae[-1] == VAE_CLASS

    def check(self, encoding: Any) -> None:
        if getattr(encoding, "text_padding", "zeros") == "raw":
            raise ConfigError(
                "--text-padding raw: family hv15 encodes each prompt alone, unpadded, as musubi-tuner's caching does: "
                "it has no pad rows of the encoder's to store; use --text-padding zeros (the hv15-musubi recipe)"
            )

    def rules(self, model_dir: Path) -> GeometryRules:
        cfg = read_json(model_dir / "vae" / "config.json")
        return GeometryRules(
            int(cfg.get("temporal_compression_ratio", 4)), 1, int(cfg.get("spatial_compression_ratio", 16))
        )

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = read_json(model_dir / "vae" / "config.json")
        t, s = int(cfg.get("temporal_compression_ratio", 4)), int(cfg.get("spatial_compression_ratio", 16))
        return (int(cfg.get("latent_channels", 32)), 1 + (frames - 1) // t, height // s, width // s)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        return (settings.max_length, int(read_json(model_dir / "text_encoder" / "config.json")["hidden_size"]))

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Hv15Encoder:
        return Hv15Encoder(model_dir, device, dtype)


def _index(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "model_index.json"
    return read_json(path) if path.exists() else {}


class Hv15Encoder(LoadedFamily):
    """Loaded VAE, Qwen2.5-VL text model, ByT5 glyph encoder and their tokenizers; model calls one at a time."""

    name = "hv15"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from diffusers import AutoencoderKLHunyuanVideo15  # noqa: PLC0415 - heavy import, only when loading
        from transformers import AutoTokenizer, T5EncoderModel  # noqa: PLC0415

        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(model_dir / "vae", torch_dtype=dtype, local_files_only=True)
        self.vae = vae.to(device).eval()
        self.text_encoder = self.load_text_encoder().to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
        path = model_dir / "text_encoder_2"
        glyph = T5EncoderModel.from_pretrained(path, torch_dtype=GLYPH_DTYPE, local_files_only=True)
        self.glyph_encoder = glyph.to(device).eval()
        self.glyph_tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer_2", local_files_only=True)
        self.crop = crop_start(self.tokenizer)
        self.image_encoder: torch.nn.Module | None = None
        self._lock, self._image_lock = threading.Lock(), threading.Lock()
        logger.info("loaded hv15 from %s on %s (%s; template crop %d tokens)", model_dir, device, dtype, self.crop)

    def set_vae_memory(self, *, tiling: bool, slicing: bool) -> None:
        """Tiling as musubi's caching tiles (`TILE` pixels, `TILE_OVERLAP`); slicing as diffusers slices."""
        if tiling:
            latent = TILE // self.vae.spatial_compression_ratio
            self.vae.enable_tiling(TILE, TILE, latent, latent, TILE_OVERLAP)
        if slicing:
            self.vae.enable_slicing()

    @torch.inference_mode()
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """(1,3,F,H,W) in [-1,1] → the posterior mode (32,F',H',W'), raw, float32 on CPU (the caller casts)."""
        with self._lock, autocast(self.device, self.dtype):
            mode = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode()
        return mode[0].float().cpu()

    @torch.inference_mode()
    def encode_conditioning(self, pixels: torch.Tensor, latents: torch.Tensor) -> ImageConditioning:
        """musubi's ``--i2v``: the first frame's latents and mask (`I2V_RECIPE`), and its SigLIP features."""
        _, frames, height, width = latents.shape
        with self._lock, autocast(self.device, self.dtype):
            first = self.vae.encode(pixels[:, :, :1].to(self.device, self.dtype)).latent_dist.mode()
        image = torch.zeros((first.shape[1] + 1, frames, height, width), dtype=torch.float32)
        image[:-1, :1] = first[0].float().cpu()
        image[-1, 0] = 1.0
        return ImageConditioning(image_latents=image, clip_features=self.siglip(pixels[0, :, 0]))

    def siglip(self, frame: torch.Tensor) -> torch.Tensor:
        """(3,H,W) in [-1,1] (musubi's ``x / 127.5 - 1`` of its uint8 frame) → the SigLIP last_hidden_state, float16."""
        from transformers import SiglipImageProcessor  # noqa: PLC0415 - heavy import, only for --mode i2v

        levels = ((frame.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)  # its uint8 frame, exactly
        inputs = SiglipImageProcessor(**SIGLIP_PROCESSOR).preprocess(
            images=levels.permute(1, 2, 0).numpy(), return_tensors="pt"
        )
        encoder = self._image_encoder()
        with self._lock:
            out = encoder(pixel_values=inputs.pixel_values.to(self.device, torch.float16)).last_hidden_state
        return out[0].cpu()

    def _image_encoder(self) -> torch.nn.Module:
        from transformers import SiglipVisionModel  # noqa: PLC0415 - heavy import, only for --mode i2v

        with self._image_lock:
            if self.image_encoder is None:
                path = self.model_dir / "image_encoder"
                loaded = SiglipVisionModel.from_pretrained(path, torch_dtype=torch.float16, local_files_only=True)
                self.image_encoder = loaded.to(self.device).eval()
        return self.image_encoder

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        with self._lock:
            pixels = self.vae.decode(latents.unsqueeze(0).to(self.device, self.dtype)).sample
        return pixels.float().cpu()[0].clamp(-1, 1)

    def load_text_encoder(self) -> torch.nn.Module:
        from transformers import Qwen2_5_VLTextModel  # noqa: PLC0415 - heavy import, only when loading

        path = self.model_dir / "text_encoder"
        return Qwen2_5_VLTextModel.from_pretrained(path, torch_dtype=self.dtype, local_files_only=True).eval()

    @torch.inference_mode()
    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        """The prompt alone through the template and Qwen2.5-VL: rows past its tokens are zeros; ``extras`` holds its
        glyph rows (``[g, D]`` float16, g may be 0)."""
        text = PROMPT_TEMPLATE.format(prompt)
        with TOKENIZER_LOCK:
            tokens = self.tokenizer(
                [text], max_length=settings.max_length + self.crop, padding=True, truncation=True, return_tensors="pt"
            )
            total = len(self.tokenizer(text, truncation=False).input_ids) - self.crop
        with self._lock, autocast(self.device, self.dtype):
            out = self.text_encoder(
                input_ids=tokens.input_ids.to(self.device),
                attention_mask=tokens.attention_mask.to(self.device),
                output_hidden_states=True,
            )
        rows = out.hidden_states[HIDDEN_STATE][0, self.crop :]
        seq_len = int(tokens.attention_mask[0, self.crop :].sum())
        embeds = torch.zeros((settings.max_length, rows.shape[-1]), dtype=torch.float32)
        embeds[:seq_len] = rows[:seq_len].float().cpu()
        return TextEmbedding(embeds.to(rows.dtype), seq_len, total, {GLYPH_KIND: self.glyph_rows(prompt)})

    def glyph_rows(self, prompt: str) -> torch.Tensor:
        """The ByT5 rows of the prompt's quoted text (musubi's), float16 on CPU; none: ``[0, D]``."""
        glyph = glyph_text(prompt)
        width = int(self.glyph_encoder.config.d_model)
        if glyph is None:
            return torch.zeros((0, width), dtype=GLYPH_DTYPE)
        with TOKENIZER_LOCK:
            tokens = self.glyph_tokenizer(
                glyph,
                padding="max_length",
                max_length=GLYPH_MAX_LENGTH,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            )
        mask = tokens.attention_mask.to(self.device)
        with self._lock, autocast(self.device, GLYPH_DTYPE):
            out = self.glyph_encoder(input_ids=tokens.input_ids.to(self.device), attention_mask=mask.float())[0]
        return out[0, : int(mask.sum())].to(GLYPH_DTYPE).cpu().contiguous()
