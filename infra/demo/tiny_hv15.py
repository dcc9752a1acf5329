"""A tiny, offline, deterministic stand-in for the ``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v``
snapshot (HunyuanVideo 1.5 in diffusers' layout, as diffusers' ``scripts/convert_hunyuan_video1_5_to_diffusers.py``
saves it).

``make_tiny_hv15`` writes the encoding half: ``model_index.json`` (``HunyuanVideo15Pipeline``), ``vae/``
(``AutoencoderKLHunyuanVideo15``), ``text_encoder/`` (``Qwen2_5_VLTextModel``, the language model of
Qwen2.5-VL-7B-Instruct that the conversion script keeps), ``tokenizer/`` (``Qwen2Tokenizer``), ``text_encoder_2/``
(``T5EncoderModel``: ByT5-small with the Glyph-SDXL-v2 weights), ``tokenizer_2/`` (``ByT5Tokenizer`` with the
glyph colour tokens added) and ``scheduler/``; no ``transformer/`` (encoding does not read it).

Each config is the real one with its widths shrunk: the VAE keeps 32 latent channels, 16x spatial / 4x temporal
compression, five levels and the scaling factor 1.03682 (block_out_channels /16, one res block per level); the
Qwen2.5-VL text model keeps its multimodal RoPE (sections scaled to the head size), RMS norm eps and rope theta with 4
layers of width 64 (the 3rd last hidden state is a middle layer's, as in the 28-layer original); ByT5 keeps gated-GELU
and its byte vocabulary with 2 layers of width 64. The Qwen tokenizer is a byte-level BPE trained here on the
HunyuanVideo 1.5 prompt template and a few captions, with Qwen's special tokens (``<|im_start|>``, ``<|im_end|>``,
``<|endoftext|>`` as pad): no Qwen tokenizer ships on PyPI. ByT5's tokenizer is the real one (bytes, no vocabulary
file). The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from infra.models.hv15_text import PROMPT_TEMPLATE, QWEN_SPLIT
from infra.storage import staged_dir

logger = logging.getLogger(__name__)

#: The real VAE config (diffusers' AutoencoderKLHunyuanVideo15 defaults: the conversion script builds it with none),
#: widths divided by 16 and one res block per level (of 2).
TINY_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 32,
    "block_out_channels": (8, 16, 32, 64, 64),
    "layers_per_block": 1,
    "spatial_compression_ratio": 16,
    "temporal_compression_ratio": 4,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
    "scaling_factor": 1.03682,
}
#: Qwen2.5-VL-7B-Instruct's text config (hidden 3584, 28 layers, 28 heads, 4 KV heads, mrope [16, 24, 24] of a
#: 128-wide head, theta 1e6, eps 1e-6) at width 64: heads of 16 with the mrope sections in the same 2:3:3 ratio.
TINY_QWEN_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
    "use_sliding_window": False,
}
#: google/byt5-small's config (gated-gelu, 32 buckets, byte vocabulary) at width 64 with 2 layers (of 12).
TINY_BYT5_CONFIG: dict[str, Any] = {
    "d_model": 64,
    "d_ff": 128,
    "d_kv": 16,
    "num_heads": 4,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.0,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "tie_word_embeddings": False,
}
#: The glyph colour tokens Glyph-SDXL-v2 adds to ByT5's tokenizer (``<color-0>`` .. ``<color-137>``: its
#: color_idx.json has 138 colours); its font tokens are left out of the tiny tokenizer.
GLYPH_COLOURS = 138
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: What the tiny Qwen tokenizer is trained on: the template and a few captions (the skimage loaders' first lines).
TRAINING_TEXT = (
    PROMPT_TEMPLATE,
    "Chelsea the cat. A rocket on its launch pad. An astronaut, Eileen Collins. Coffee in a cup.",
    'A sign that reads "OPEN" hangs on a door. The text “欢迎” in red. A dog runs on the grass, realistic.',
)
QWEN_VOCAB = 600
#: The scheduler's shift for the 480p models in diffusers' conversion script.
FLOW_SHIFT = 5.0
VARIANTS = ("t2v", "i2v")
#: The SigLIP vision tower (siglip-so400m-patch14-384, FLUX.1-Redux's, as musubi's framepack_utils configures it:
#: 384 px, patch 14 = 729 tokens, gelu_pytorch_tanh, eps 1e-6) at width 64 with 2 layers (of 27).
TINY_SIGLIP_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 384,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


def build_qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE with Qwen2's pre-tokenizer, trained on `TRAINING_TEXT`; pads on the right."""

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=QWEN_VOCAB,
        special_tokens=list(QWEN_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(TRAINING_TEXT), trainer=trainer)
    state = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=state["vocab"], merges=merges, padding_side="right", model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def build_byt5_tokenizer() -> ByT5Tokenizer:
    """google/byt5-small's tokenizer with the glyph colour tokens added as special tokens."""
    tokenizer = ByT5Tokenizer()
    tokenizer.add_tokens([f"<color-{i}>" for i in range(GLYPH_COLOURS)], special_tokens=True)
    return tokenizer


def model_index(variant: str = "t2v") -> dict[str, Any]:
    """model_index.json as diffusers 0.42's ``save_pretrained`` writes it for HunyuanVideo15Pipeline (``t2v``) or
    HunyuanVideo15ImageToVideoPipeline (``i2v``: with its image encoder and feature extractor)."""
    i2v = {
        "image_encoder": ["transformers", "SiglipVisionModel"],
        "feature_extractor": ["transformers", "SiglipImageProcessor"],
    }
    return {
        **(i2v if variant == "i2v" else {}),
        "_class_name": "HunyuanVideo15ImageToVideoPipeline" if variant == "i2v" else "HunyuanVideo15Pipeline",
        "_diffusers_version": diffusers.__version__,
        "guider": ["diffusers", "ClassifierFreeGuidance"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "tokenizer_2": ["transformers", "ByT5Tokenizer"],
        "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo15"],
    }


def _write_vae(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(**TINY_VAE_CONFIG)
    vae.save_pretrained(out, safe_serialization=True)
    logger.info("tiny HunyuanVideo 1.5 vae: %d parameters", sum(p.numel() for p in vae.parameters()))


def _write_qwen(out: Path, seed: int, tokenizer: Qwen2Tokenizer) -> None:
    torch.manual_seed(seed + 1)
    vocab = -(-len(tokenizer) // 64) * 64
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    config = Qwen2_5_VLTextConfig(vocab_size=vocab, bos_token_id=None, **ids, **TINY_QWEN_CONFIG)
    model = Qwen2_5_VLTextModel(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    logger.info("tiny Qwen2.5-VL text model: %d parameters", model.num_parameters())


def _write_byt5(out: Path, seed: int, tokenizer: ByT5Tokenizer) -> None:
    torch.manual_seed(seed + 2)
    model = T5EncoderModel(T5Config(vocab_size=len(tokenizer), **TINY_BYT5_CONFIG)).eval()
    model.save_pretrained(out, safe_serialization=True)
    logger.info("tiny ByT5 glyph encoder: %d parameters", model.num_parameters())


def _write_siglip(out: Path, seed: int) -> None:
    torch.manual_seed(seed + 3)
    model = SiglipVisionModel(SiglipVisionConfig(**TINY_SIGLIP_CONFIG)).eval()
    model.save_pretrained(out / "image_encoder", safe_serialization=True)
    size = {"height": TINY_SIGLIP_CONFIG["image_size"], "width": TINY_SIGLIP_CONFIG["image_size"]}
    SiglipImageProcessor(size=size, resample=3).save_pretrained(out / "feature_extractor")
    logger.info("tiny SigLIP image encoder: %d parameters", model.num_parameters())


def make_tiny_hv15(
    out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None, variant: str = "t2v", **_: Any
) -> Path:
    """Write the tiny snapshot of `variant` (`VARIANTS`) into ``out_dir`` (absent or empty; built in a sibling folder
    and moved into place). ``tokenizer_dir`` (a local Qwen2.5-VL tokenizer folder) replaces the trained one."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    with staged_dir(Path(out_dir), "the tiny HunyuanVideo 1.5 snapshot") as staging, torch.random.fork_rng(devices=[]):
        if tokenizer_dir is not None:
            qwen = Qwen2Tokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        else:
            qwen = build_qwen_tokenizer()
        qwen.save_pretrained(staging / "tokenizer")
        byt5 = build_byt5_tokenizer()
        byt5.save_pretrained(staging / "tokenizer_2")
        _write_vae(staging / "vae", seed)
        _write_qwen(staging / "text_encoder", seed, qwen)
        _write_byt5(staging / "text_encoder_2", seed, byt5)
        if variant == "i2v":
            _write_siglip(staging, seed)
        FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT).save_pretrained(staging / "scheduler")
        index = json.dumps(model_index(variant), indent=2, sort_keys=True)
        (staging / "model_index.json").write_text(index + "\n")
    logger.info("wrote the tiny HunyuanVideo 1.5 snapshot to %s (seed %d)", out_dir, seed)
    return Path(out_dir)
