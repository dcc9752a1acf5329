"""Tiny, offline, deterministic image models with the real diffusers / transformers classes.

``make_tiny_image`` writes a diffusers-layout directory: ``model_index.json``, ``vae/`` (``AutoencoderKL`` with
Flux's scaling and shift factors, or ``AutoencoderDC`` with Sana's scaling factor; 4x spatial compression) and,
unless ``text="none"``, ``text_encoder/`` (``CLIPTextModel`` or ``T5EncoderModel``) + ``tokenizer/`` (the real
CLIP or T5 tokenizer from the test-media cache, `infra.demo.testmedia`, or a given folder). Random weights from
`seed`; the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

import diffusers
import torch
from diffusers import AutoencoderDC, AutoencoderKL
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from infra.demo.testmedia import real_clip_tokenizer_dir, real_t5_tokenizer_dir
from infra.storage import staged_dir

logger = logging.getLogger(__name__)

VaeKind = Literal["kl", "dc"]
TextKind = Literal["clip", "t5", "none"]
#: FLUX.1's VAE normalisation (its vae/config.json) and Sana's DC-AE scaling factor.
FLUX_SCALING, FLUX_SHIFT = 0.3611, 0.1159
SANA_SCALING = 0.41407
TINY_CHANNELS = (8, 16, 16)  # three levels: 4x spatial compression


def _kl(seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * len(TINY_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(TINY_CHANNELS),
        block_out_channels=TINY_CHANNELS,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=FLUX_SCALING,
        shift_factor=FLUX_SHIFT,
        mid_block_add_attention=False,
    )


def _dc(seed: int) -> AutoencoderDC:
    torch.manual_seed(seed)
    levels = len(TINY_CHANNELS)
    return AutoencoderDC(
        latent_channels=8,
        attention_head_dim=8,
        encoder_block_types="ResBlock",
        decoder_block_types="ResBlock",
        encoder_block_out_channels=TINY_CHANNELS,
        decoder_block_out_channels=TINY_CHANNELS,
        encoder_layers_per_block=(1,) * levels,
        decoder_layers_per_block=(1,) * levels,
        encoder_qkv_multiscales=((),) * levels,
        decoder_qkv_multiscales=((),) * levels,
        scaling_factor=SANA_SCALING,
    )


def _text_encoder(kind: TextKind, seed: int, vocab_size: int) -> CLIPTextModel | T5EncoderModel:
    torch.manual_seed(seed)
    if kind == "clip":
        config = CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=49406,
            eos_token_id=49407,
            pad_token_id=49407,
        )
        return CLIPTextModel(config).eval()
    config = T5Config(vocab_size=-(-vocab_size // 128) * 128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return T5EncoderModel(config).eval()


def _tokenizer_dir(kind: TextKind, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    return real_clip_tokenizer_dir() if kind == "clip" else real_t5_tokenizer_dir()


def make_tiny_image(
    out_dir: Path, *, seed: int = 0, vae: VaeKind = "kl", text: TextKind = "clip", tokenizer_dir: Path | None = None
) -> Path:
    """Write a tiny image model (see the module docstring) into `out_dir` (absent or empty); returns it."""
    if vae not in ("kl", "dc") or text not in ("clip", "t5", "none"):
        raise ValueError(f"--vae kl|dc and --text clip|t5|none, not {vae!r} / {text!r}")
    out_dir = Path(out_dir)
    with staged_dir(out_dir, "the tiny image model") as staging:
        model = _kl(seed) if vae == "kl" else _dc(seed)
        model.save_pretrained(staging / "vae", safe_serialization=True)
        index = {"_class_name": "LatentforgeImagePipeline", "_diffusers_version": diffusers.__version__}
        index["vae"] = ["diffusers", type(model).__name__]
        if text != "none":
            tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir(text, tokenizer_dir), local_files_only=True)
            tokenizer.save_pretrained(staging / "tokenizer")
            encoder = _text_encoder(text, seed, len(tokenizer))
            encoder.save_pretrained(staging / "text_encoder", safe_serialization=True)
            index["text_encoder"] = ["transformers", type(encoder).__name__]
            index["tokenizer"] = ["transformers", type(tokenizer).__name__]
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    logger.info("wrote tiny image model (%s VAE, %s text) to %s (seed %d)", vae, text, out_dir, seed)
    return out_dir
