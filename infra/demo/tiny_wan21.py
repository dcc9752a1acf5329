"""Tiny, offline, deterministic stand-ins for the Wan snapshots with the 16-channel Wan2.1 VAE, from their real
configs: ``Wan-AI/Wan2.1-T2V-*-Diffusers`` (``t2v``), ``Wan2.1-I2V-14B-*-Diffusers`` (``i2v``: a CLIP image encoder
and its image processor), ``Wan2.2-T2V-A14B-Diffusers`` (``t2v-a14b``) and ``Wan2.2-I2V-A14B-Diffusers``
(``i2v-a14b``: two transformers, no image encoder). No ``transformer/`` is written (encoding does not read it).

The VAE is the real Wan2.1 config (`infra.models.wan_constants.WAN21_VAE_CONFIG`: z_dim 16, the real latent
statistics) with only ``base_dim`` and ``num_res_blocks`` shrunk; the text encoder and tokenizer are the tiny Wan2.2
ones (`infra.demo.tiny.make_tiny_wan22`, the same UMT5 architecture); the image encoder is transformers'
``CLIPVisionModel`` of ViT-H/14's config (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: 224 px, patch 14, width 1280,
which the Wan transformers' image projection takes) with fewer layers and a narrower MLP. The same seed gives
byte-identical files.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from infra.demo.tiny import make_tiny_wan22
from infra.models.wan_constants import WAN21_VAE_CONFIG
from infra.storage import staged_dir

logger = logging.getLogger(__name__)

VARIANTS = ("t2v", "i2v", "t2v-a14b", "i2v-a14b")
TINY_VAE_OVERRIDES = {"base_dim": 8, "num_res_blocks": 1}
#: ViT-H/14's vision config, with 2 of its 32 layers and a 256-wide MLP (of 5120): hidden_states[-2] still differs
#: from the last layer's, and the width stays the 1280 the Wan image projection takes.
TINY_CLIP = {
    "hidden_size": 1280,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 224,
    "projection_dim": 1024,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}
#: The schedulers' flow shift in diffusers' conversion script (3.0 for these models; 5.0 is TI2V-5B's).
FLOW_SHIFT = 3.0
#: Wan2.2 A14B: the step where the low-noise transformer takes over (the conversion script's boundary_ratio).
BOUNDARY = {"t2v-a14b": 0.875, "i2v-a14b": 0.9}


def model_index(variant: str) -> dict[str, Any]:
    """model_index.json as diffusers 0.42's ``save_pretrained`` writes it for the variant's pipeline."""
    i2v = variant.startswith("i2v")
    a14b = variant.endswith("a14b")
    index: dict[str, Any] = {
        "_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": BOUNDARY.get(variant),
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if a14b else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if i2v:
        with_clip = not a14b
        index["image_encoder"] = ["transformers", "CLIPVisionModel"] if with_clip else [None, None]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"] if with_clip else [None, None]
    else:
        index["expand_timesteps"] = False
    return index


def _write_vae(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**{**WAN21_VAE_CONFIG, **TINY_VAE_OVERRIDES})
    vae.save_pretrained(out, safe_serialization=True)
    logger.info("tiny Wan2.1 vae: %d parameters", sum(p.numel() for p in vae.parameters()))


def _write_image_encoder(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    model = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP)).eval()
    model.save_pretrained(out / "image_encoder", safe_serialization=True)
    CLIPImageProcessor().save_pretrained(out / "image_processor")  # its defaults are ViT-H/14's (224, OpenAI mean/std)
    logger.info("tiny CLIP image encoder: %d parameters", model.num_parameters())


def make_tiny_wan21(
    out_dir: Path, *, variant: str = "t2v", seed: int = 0, tokenizer_dir: Path | None = None, **_: Any
) -> Path:
    """Write a tiny snapshot of `variant` (`VARIANTS`) into ``out_dir`` (absent or empty; built in a sibling folder
    and moved into place). ``tokenizer_dir`` replaces the built-in tokenizer, as for `make_tiny_wan22`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    with staged_dir(Path(out_dir), f"the tiny Wan2.1-VAE {variant} snapshot") as staging:
        text = make_tiny_wan22(staging / ".text", seed=seed, tokenizer_dir=tokenizer_dir)
        for part in ("text_encoder", "tokenizer"):
            (text / part).replace(staging / part)
        shutil.rmtree(text)  # its Wan2.2 VAE, scheduler and index are not this model's
        _write_vae(staging / "vae", seed)
        UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=FLOW_SHIFT
        ).save_pretrained(staging / "scheduler")
        index = model_index(variant)
        if index.get("image_encoder", [None])[-1] is not None:
            _write_image_encoder(staging, seed)
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    logger.info("wrote the tiny %s snapshot (Wan2.1 VAE) to %s (seed %d)", variant, out_dir, seed)
    return Path(out_dir)
