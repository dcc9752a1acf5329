"""The Wan2.1 VAE family (AutoencoderKLWan with z_dim 16: 8x spatial, 4x temporal) with the UMT5 text encoder:
Wan2.1 T2V and I2V, Wan2.2 T2V-A14B and I2V-A14B snapshots (diffusers layout), told from ``model_index.json``
(``WanPipeline`` or ``WanImageToVideoPipeline`` with a z_dim 16 VAE; a Wan2.2-TI2V-5B snapshot, z_dim 48, is
`infra.models.wan22`'s). Latents are normalised with the snapshot's own ``latents_mean`` / ``latents_std``.

An image-to-video snapshot (``WanImageToVideoPipeline``) takes ``--mode i2v``: each sample also stores ``y`` (mask +
first-frame latents) and, where the snapshot has an ``image_encoder`` (Wan2.1 I2V; the Wan2.2 A14B has none), its
CLIP features (`infra.models.wan_i2v`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

from infra.errors import ConfigError
from infra.models.base import GeometryRules, ImageConditioning, read_json
from infra.models.wan22 import Wan22Encoder, Wan22Spec
from infra.models.wan_i2v import clip_pixels, first_frame_mask, first_frame_video

logger = logging.getLogger(__name__)

Z_DIM = 16
I2V_PIPELINE = "WanImageToVideoPipeline"
PIPELINES = ("WanPipeline", I2V_PIPELINE)
#: The image encoder and its preprocessing config, read where the snapshot has them (Wan2.1 I2V).
IMAGE_COMPONENTS = ("image_encoder", "image_processor")
#: Pixels per latent step across: the VAE's 8, times the transformer's 2x2 patch (musubi's and DiffSynth's 16).
SPATIAL_MULTIPLE = 16
#: What the spec's ``conditioning`` says an I2V cache stores (`infra.models.wan_i2v`).
Y_RECIPE = "y: 4-channel first-frame mask + normalised VAE mean of (first frame, F-1 black frames)"
CLIP_RECIPE = "clip: image_encoder hidden_states[-2] of the first frame (bicubic to its size, CLIP mean/std)"


def has_component(index: dict[str, Any], name: str) -> bool:
    """Whether model_index.json names a component (a ``[null, null]`` entry is none)."""
    entry = index.get(name) or [None, None]
    return entry[-1] is not None


def vae_z_dim(model_dir: Path) -> Any:
    return read_json(model_dir / "vae" / "config.json").get("z_dim")


class Wan21Spec(Wan22Spec):
    """Detection, constraints and loading for the wan21 family."""

    name = "wan21"
    components = ("vae", "text_encoder", "tokenizer")

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        vae = index.get("vae") or [None, None]
        if vae[-1] != "AutoencoderKLWan" or index.get("_class_name") not in PIPELINES:
            return False
        return vae_z_dim(model_dir) == Z_DIM

    def components_in(self, model_dir: Path, audio: bool = False) -> tuple[str, ...]:
        index = _index(model_dir)
        return self.components + (IMAGE_COMPONENTS if has_component(index, "image_encoder") else ())

    def rules(self, model_dir: Path) -> GeometryRules:
        z_dim = vae_z_dim(model_dir)
        if z_dim != Z_DIM:
            raise ConfigError(
                f"{model_dir}: AutoencoderKLWan with z_dim={z_dim} is not the Wan2.1 VAE (z_dim {Z_DIM}) of family "
                "wan21; a Wan2.2-TI2V-5B snapshot (z_dim 48) is family wan22"
            )
        cfg = read_json(model_dir / "vae" / "config.json")
        return GeometryRules(int(cfg.get("scale_factor_temporal", 4)), 1, SPATIAL_MULTIPLE)

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        cfg = read_json(model_dir / "vae" / "config.json")
        t, s = int(cfg.get("scale_factor_temporal", 4)), int(cfg.get("scale_factor_spatial", 8))
        return (int(cfg["z_dim"]), 1 + (frames - 1) // t, height // s, width // s)

    def kinds(self, spec: Any) -> tuple[str, ...]:
        if getattr(spec, "mode", "t2v") != "i2v":
            return super().kinds(spec)
        clip = ("clip_features",) if "image_encoder" in spec.model_identity else ()
        return (*self.output_kinds, "image_latents", *clip)

    def conditioning(self, model_dir: Path, mode: str) -> str | None:
        if mode != "i2v":
            return None
        index = _index(model_dir)
        if index.get("_class_name") != I2V_PIPELINE:
            raise ConfigError(
                f"--mode i2v: {model_dir} is a text-to-video Wan snapshot ({index.get('_class_name')}): its "
                f"transformer takes no image conditioning; give a {I2V_PIPELINE} snapshot (Wan2.1-I2V, Wan2.2-I2V-A14B)"
            )
        return Y_RECIPE + ("; " + CLIP_RECIPE if has_component(index, "image_encoder") else "")

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Wan21Encoder:
        return Wan21Encoder(model_dir, device, dtype)


def _index(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "model_index.json"
    return read_json(path) if path.exists() else {}


class Wan21Encoder(Wan22Encoder):
    """The wan22 encoder's VAE and UMT5 code (generic over AutoencoderKLWan), plus the I2V conditioning; the image
    encoder is loaded on first use (a text-to-video build of an I2V snapshot never loads it)."""

    name = "wan21"

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_dir, device, dtype)
        self.image_encoder: torch.nn.Module | None = None
        self._image_lock = threading.Lock()

    @torch.inference_mode()
    def encode_conditioning(self, pixels: torch.Tensor, latents: torch.Tensor) -> ImageConditioning:
        frames, (_, _, latent_h, latent_w) = pixels.shape[2], latents.shape
        (image,) = self.encode_raw_videos([first_frame_video(pixels)])
        y = torch.cat([first_frame_mask(frames, latent_h, latent_w), self.normalise(image)])
        clip = self.clip_features(pixels[0, :, 0]) if (self.model_dir / "image_encoder").is_dir() else None
        return ImageConditioning(image_latents=y, clip_features=clip)

    def clip_features(self, frame: torch.Tensor) -> torch.Tensor:
        """(3,H,W) in [-1,1] → the image encoder's next-to-last hidden states (N, D), float32 on CPU."""
        encoder, config = self._image_encoder()
        x = clip_pixels(frame, encoder.config.image_size, config["image_mean"], config["image_std"])
        with self._lock:
            out = encoder(pixel_values=x.to(self.device, self.dtype), output_hidden_states=True)
        return out.hidden_states[-2][0].float().cpu()

    def _image_encoder(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        from transformers import CLIPVisionModel  # noqa: PLC0415 - heavy import, only when loading

        config = read_json(self.model_dir / "image_processor" / "preprocessor_config.json")
        with self._image_lock:
            if self.image_encoder is None:
                path = self.model_dir / "image_encoder"
                loaded = CLIPVisionModel.from_pretrained(path, torch_dtype=self.dtype, local_files_only=True)
                self.image_encoder = loaded.to(self.device).eval()
                logger.info("loaded the wan21 image encoder from %s", path)
        return self.image_encoder, config
