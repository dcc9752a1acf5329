"""The Wan2.1 VAE family (AutoencoderKLWan with z_dim 16: 8x spatial, 4x temporal) with the UMT5 text encoder:
Wan2.1 T2V and I2V, Wan2.2 T2V-A14B and I2V-A14B snapshots (diffusers layout), told from ``model_index.json``
(``WanPipeline`` or ``WanImageToVideoPipeline`` with a z_dim 16 VAE; a Wan2.2-TI2V-5B snapshot, z_dim 48, is
`infra.models.wan22`'s). Latents are normalised with the snapshot's own ``latents_mean`` / ``latents_std``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from infra.errors import ConfigError
from infra.models.base import GeometryRules, read_json
from infra.models.wan22 import Wan22Encoder, Wan22Spec

logger = logging.getLogger(__name__)

Z_DIM = 16
I2V_PIPELINE = "WanImageToVideoPipeline"
PIPELINES = ("WanPipeline", I2V_PIPELINE)
#: The image encoder and its preprocessing config, read where the snapshot has them (Wan2.1 I2V).
IMAGE_COMPONENTS = ("image_encoder", "image_processor")
#: Pixels per latent step across: the VAE's 8, times the transformer's 2x2 patch (musubi's and DiffSynth's 16).
SPATIAL_MULTIPLE = 16


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

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Wan21Encoder:
        return Wan21Encoder(model_dir, device, dtype)


def _index(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "model_index.json"
    return read_json(path) if path.exists() else {}


class Wan21Encoder(Wan22Encoder):
    """The wan22 encoder's VAE and UMT5 code (generic over AutoencoderKLWan: its statistics from the config)."""

    name = "wan21"
