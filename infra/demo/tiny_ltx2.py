"""A tiny, offline, deterministic stand-in for the ``Lightricks/LTX-2`` diffusers snapshot (LTX-2.0 layout).

``make_tiny_ltx2`` writes the encoding half of that snapshot: ``model_index.json``, ``vae/``
(``AutoencoderKLLTX2Video``), ``audio_vae/`` (``AutoencoderKLLTX2Audio``), ``text_encoder/``
(``Gemma3ForConditionalGeneration``), ``tokenizer/`` (Gemma), ``connectors/`` (``LTX2TextConnectors``) and
``scheduler/``; no ``transformer/`` or ``vocoder/`` (the index names them as the real one does). The geometry
is the real one (128 latent channels, 32x spatial / 8x temporal video compression, 16 kHz / hop 160 / 64-bin
stereo mel audio with 4x time and mel compression, 8 audio latent channels, 1024-token left-padded prompts,
per-layer normalised Gemma hidden states into the connectors) with random, very small weights and
non-identity latent statistics. Nothing is downloaded. The same seed gives byte-identical files.

``version`` picks the text side: ``2.0`` (Gemma 3, one shared ``text_proj_in``), ``2.3`` (Gemma 3, per-modality
projections: 2.3's feature extractor) or ``2.5`` (Gemma 4, ``Gemma4UnifiedForConditionalGeneration`` without vision
or audio towers, a tokenizer that does not add ``<bos>`` as Gemma 4's does not, and 2.3's projections). The video and
audio VAEs are the same tiny ones for every version.
"""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from transformers import (
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
    GemmaTokenizer,
    PreTrainedTokenizerBase,
)

from infra.storage import staged_dir

logger = logging.getLogger(__name__)

#: What LTX2Pipeline tokenizes to (``max_sequence_length``); the register counts must divide it.
MAX_SEQUENCE_LENGTH = 1024

#: The tiny video VAE: the real LTX-2.0 block layout, narrow channels. The compression ratios must be given:
#: the default formula (``patch_size * 2 ** sum(spatio_temporal_scaling)``) gives 64 and 16 here.
TINY_VIDEO_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    "block_out_channels": (32, 32, 64, 64),
    "down_block_types": ("LTX2VideoDownBlock3D",) * 4,
    "decoder_block_out_channels": (16, 32, 64),
    "layers_per_block": (0, 1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1),
    "spatio_temporal_scaling": (True,) * 4,
    "decoder_spatio_temporal_scaling": (True,) * 3,
    "decoder_inject_noise": (False,) * 4,
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_type": ("spatiotemporal",) * 3,
    "upsample_residual": (True,) * 3,
    "upsample_factor": (2, 2, 2),
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "scaling_factor": 1.0,  # the real vae/config.json value
    "encoder_causal": True,
    "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
}

#: The tiny audio VAE: the real LTX-2.0 config but ``ch_mult`` (1, 1, 1) and one res block per level.
#: ``base_channels`` stays 128 because ``latents_mean``/``latents_std`` have ``base_channels`` entries and the
#: pipeline applies them to the packed ``latent_channels * mel_bins / 4`` = 8 * 16 = 128 axis. ``ch_mult`` must
#: have 3 entries: 2 downsamples = the 4x time/mel compression the pipeline hard-codes.
TINY_AUDIO_VAE_CONFIG: dict[str, Any] = {
    "base_channels": 128,
    "output_channels": 2,
    "ch_mult": (1, 1, 1),
    "num_res_blocks": 1,
    "attn_resolutions": None,
    "in_channels": 2,
    "resolution": 256,
    "latent_channels": 8,
    "norm_type": "pixel",
    "causality_axis": "height",
    "dropout": 0.0,
    "mid_block_add_attention": False,
    "sample_rate": 16000,
    "mel_hop_length": 160,
    "is_causal": True,
    "mel_bins": 64,
    "double_z": True,
}

#: ``vae_size="full"``: the video and audio VAEs at LTX-2.0's sizes (diffusers' own defaults for these classes:
#: its LTX-2 configs), the tiny layout's other settings kept (for `bench/gpu/shot.py`: the VAEs' real FLOPs).
FULL_VIDEO_VAE_OVERRIDES: dict[str, Any] = {
    "block_out_channels": (256, 512, 1024, 2048),
    "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2),
    "decoder_layers_per_block": (5, 5, 5, 5),
}
FULL_AUDIO_VAE_OVERRIDES: dict[str, Any] = {"ch_mult": (1, 2, 4), "num_res_blocks": 2}

#: The tiny Gemma-3 text model. ``query_pre_attn_scalar`` = head_dim, as Gemma-3-12B (256 = its head_dim).
TINY_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 64,
    "max_position_embeddings": 4096,
}

#: A minimal SigLIP tower: Gemma3ForConditionalGeneration needs one, LTX-2 never feeds it images.
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
MM_TOKENS_PER_IMAGE = 4  # a square number dividing (image_size / patch_size) ** 2 = 16

#: LTX-2.0 connectors (one shared ``text_proj_in``, ``per_modality_projections`` False), tiny. ``caption_channels``
#: is the text hidden size and ``text_proj_in_factor`` the number of hidden states (embeddings + every layer);
#: heads x head_dim must equal ``caption_channels``. rope/seq-len settings as the real connectors/config.json.
TINY_CONNECTORS_CONFIG: dict[str, Any] = {
    "caption_channels": TINY_TEXT_CONFIG["hidden_size"],
    "text_proj_in_factor": TINY_TEXT_CONFIG["num_hidden_layers"] + 1,
    "video_connector_num_attention_heads": 4,
    "video_connector_attention_head_dim": 16,
    "video_connector_num_layers": 1,
    "video_connector_num_learnable_registers": 8,
    "audio_connector_num_attention_heads": 4,
    "audio_connector_attention_head_dim": 16,
    "audio_connector_num_layers": 1,
    "audio_connector_num_learnable_registers": 8,
    "connector_rope_base_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_temporal_positioning": False,
    "rope_type": "split",
    "per_modality_projections": False,
}

#: LTX-2.3 / 2.5 connectors: a projection per modality (with bias, as ltx-core's FeatureExtractorV2), each into its
#: connector's width (heads x head_dim): video 4 x 16, audio 2 x 16.
TINY_PER_MODALITY_CONNECTORS: dict[str, Any] = {
    **TINY_CONNECTORS_CONFIG,
    "audio_connector_num_attention_heads": 2,
    "per_modality_projections": True,
    "proj_bias": True,
    "video_hidden_dim": 64,
    "audio_hidden_dim": 32,
}

#: The tiny Gemma-4 (``gemma4_unified``) text model: the Gemma-3 sizes; its full-attention layers' head_dim
#: (``global_head_dim``, 512 by default) set to the same 16.
TINY_GEMMA4_TEXT_CONFIG: dict[str, Any] = {
    **{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "query_pre_attn_scalar"},
    "global_head_dim": TINY_TEXT_CONFIG["head_dim"],
}

#: The versions ``make_tiny_ltx2`` writes; the text encoder class each one's model_index.json names.
VERSIONS = ("2.0", "2.3", "2.5")
TEXT_ENCODER_CLASSES = {
    "2.0": "Gemma3ForConditionalGeneration",
    "2.3": "Gemma3ForConditionalGeneration",
    "2.5": "Gemma4UnifiedForConditionalGeneration",
}

#: The scheduler diffusers' convert_ltx2_to_diffusers.py saves into the real snapshot.
SCHEDULER_CONFIG: dict[str, Any] = {
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}

#: Gemma's special tokens at Gemma's ids 0-4, then the chat and image markers (ids 5-9).
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
EXTRA_SPECIAL_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")

MODEL_INDEX = {
    "_class_name": "LTX2Pipeline",
    "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
    "connectors": ["ltx2", "LTX2TextConnectors"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
    "tokenizer": ["transformers", "GemmaTokenizerFast"],
    "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],  # not written: encoding does not need it
    "vae": ["diffusers", "AutoencoderKLLTX2Video"],
    "vocoder": ["ltx2", "LTX2Vocoder"],  # not written: encoding does not need it
}

# Seed offsets so that the components (and the latent statistics) do not share random streams.
_SEED_VAE, _SEED_AUDIO_VAE, _SEED_TEXT, _SEED_CONNECTORS, _SEED_STATS = 0, 1, 2, 3, 4


def build_tokenizer(add_bos: bool = True) -> PreTrainedTokenizerBase:
    """A small Gemma tokenizer built offline: BPE without merges over bytes and printable characters.

    ids 0-4 are ``<pad> <eos> <bos> <unk> <mask>`` as in Gemma, 5-9 the chat/image markers (special tokens),
    then the 256 byte-fallback tokens ``<0x00>``..``<0xFF>``, ``▁`` and the printable ASCII characters; every
    other character is spelt in UTF-8 bytes. ``<bos>`` is prepended (``add_bos``: Gemma 3's; Gemma 4's tokenizer adds
    none), padding is on the left (Gemma's default).
    ``save_pretrained`` output reloads with ``AutoTokenizer`` as ``GemmaTokenizerFast`` (= ``GemmaTokenizer`` in
    transformers 5).
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + EXTRA_SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in ["▁", *(c for c in string.printable if not c.isspace())]:
        vocab.setdefault(char, len(vocab))
    return GemmaTokenizer(
        vocab=vocab,
        merges=[],
        add_bos_token=add_bos,
        add_eos_token=False,
        extra_special_tokens=list(EXTRA_SPECIAL_TOKENS),
    )


def _load_local_tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    # A missing path would otherwise be taken for a Hub repo id; never go online from here.
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory")
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def latent_statistics(seed: int, component: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel latent statistics ``make_tiny_ltx2(seed=seed)`` stores in ``component`` ("vae" or
    "audio_vae"): 128 non-identity values each, mean ~ 0.1·N(0, 1) and std in [0.5, 1.5), so that a missing or
    doubled normalisation shows."""
    offset = {"vae": _SEED_VAE, "audio_vae": _SEED_AUDIO_VAE}[component]
    generator = torch.Generator().manual_seed(1000 * seed + 10 * _SEED_STATS + offset)
    mean = 0.1 * torch.randn(128, generator=generator)
    std = 0.5 + torch.rand(128, generator=generator)
    return mean, std


def _set_statistics(model: torch.nn.Module, seed: int, component: str) -> None:
    mean, std = latent_statistics(seed, component)
    with torch.no_grad():
        model.latents_mean.copy_(mean)  # a shape mismatch fails here
        model.latents_std.copy_(std)


def _write_vae(out: Path, seed: int, full: bool = False) -> None:
    torch.manual_seed(seed + _SEED_VAE)
    vae = AutoencoderKLLTX2Video(**TINY_VIDEO_VAE_CONFIG | (FULL_VIDEO_VAE_OVERRIDES if full else {})).eval()
    _set_statistics(vae, seed, "vae")
    vae.save_pretrained(out, safe_serialization=True)
    logger.info("tiny LTX-2 video vae: %d parameters", sum(p.numel() for p in vae.parameters()))


def _write_audio_vae(out: Path, seed: int, full: bool = False) -> None:
    torch.manual_seed(seed + _SEED_AUDIO_VAE)
    audio_vae = AutoencoderKLLTX2Audio(**TINY_AUDIO_VAE_CONFIG | (FULL_AUDIO_VAE_OVERRIDES if full else {})).eval()
    _set_statistics(audio_vae, seed, "audio_vae")
    audio_vae.save_pretrained(out, safe_serialization=True)
    logger.info("tiny LTX-2 audio vae: %d parameters", sum(p.numel() for p in audio_vae.parameters()))


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str, default: int) -> int:
    return tokenizer.get_vocab().get(token, default)


def _text_config(base: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """A Gemma text config over `base`: the tokenizer's vocabulary (rounded up to 128) and special token ids."""
    return {
        **base,
        "vocab_size": -(-len(tokenizer) // 128) * 128,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        "eos_token_id": tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 1,
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 2,
    }


def _write_text_encoder(out: Path, seed: int, tokenizer: PreTrainedTokenizerBase) -> None:
    text_config = _text_config(TINY_TEXT_CONFIG, tokenizer)
    vocab_size = text_config["vocab_size"]
    config = Gemma3Config(
        text_config=text_config,
        vision_config=dict(TINY_VISION_CONFIG),
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=_token_id(tokenizer, "<start_of_image>", 255_999),
        eoi_token_index=_token_id(tokenizer, "<end_of_image>", 256_000),
        image_token_index=_token_id(tokenizer, "<image_soft_token>", 262_144),
    )
    torch.manual_seed(seed + _SEED_TEXT)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    logger.info("tiny Gemma-3 text encoder: %d parameters, vocab %d", model.num_parameters(), vocab_size)


def _write_gemma4(out: Path, seed: int, tokenizer: PreTrainedTokenizerBase) -> None:
    """Gemma 4 (``gemma4_unified``) without its vision and audio towers: LTX-2 feeds it text only."""
    text_config = _text_config(TINY_GEMMA4_TEXT_CONFIG, tokenizer)
    vocab_size = text_config["vocab_size"]
    config = Gemma4UnifiedConfig(text_config=text_config, vision_config=None, audio_config=None)
    torch.manual_seed(seed + _SEED_TEXT)
    model = Gemma4UnifiedForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    logger.info("tiny Gemma-4 text encoder: %d parameters, vocab %d", model.num_parameters(), vocab_size)


def _write_connectors(out: Path, seed: int, version: str) -> None:
    torch.manual_seed(seed + _SEED_CONNECTORS)
    config = TINY_CONNECTORS_CONFIG if version == "2.0" else TINY_PER_MODALITY_CONNECTORS
    connectors = LTX2TextConnectors(**config).eval()
    connectors.save_pretrained(out, safe_serialization=True)
    logger.info("tiny LTX-2 text connectors: %d parameters", sum(p.numel() for p in connectors.parameters()))


def _write_model_index(out_dir: Path, version: str) -> None:
    text_encoder = ["transformers", TEXT_ENCODER_CLASSES[version]]
    index = {**MODEL_INDEX, "text_encoder": text_encoder, "_diffusers_version": diffusers.__version__}
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def make_tiny_ltx2(
    out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None, version: str = "2.0", vae_size: str = "tiny"
) -> Path:
    """Write a tiny Lightricks/LTX-2-layout pipeline (without transformer and vocoder) of LTX `version` (`VERSIONS`)
    into ``out_dir``.

    ``tokenizer_dir`` (a local tokenizer folder, e.g. a real Gemma-3 one) replaces the built-in tokenizer; the
    text encoder's vocabulary is sized to it. ``out_dir`` must be absent or empty: nothing is overwritten.
    Files are built in a sibling temporary folder and moved into place at the end, so a failure leaves no
    partial pipeline. The caller's torch RNG state is left as it was. ``vae_size="full"`` makes both VAEs at their
    real sizes (`FULL_VIDEO_VAE_OVERRIDES`), the text side staying tiny. Returns ``out_dir``.
    """
    if version not in VERSIONS:
        raise ValueError(f"tiny LTX-2 versions: {', '.join(VERSIONS)}, not {version!r}")
    out_dir = Path(out_dir)
    with staged_dir(out_dir, "the tiny LTX-2 pipeline") as staging, torch.random.fork_rng(devices=[]):
        gemma4 = version == "2.5"
        local = tokenizer_dir is not None
        tokenizer = _load_local_tokenizer(Path(tokenizer_dir)) if local else build_tokenizer(add_bos=not gemma4)
        tokenizer.save_pretrained(staging / "tokenizer")
        _write_vae(staging / "vae", seed, full=vae_size == "full")
        _write_audio_vae(staging / "audio_vae", seed, full=vae_size == "full")
        (_write_gemma4 if gemma4 else _write_text_encoder)(staging / "text_encoder", seed, tokenizer)
        _write_connectors(staging / "connectors", seed, version)
        FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(staging / "scheduler")
        _write_model_index(staging, version)
    logger.info("wrote tiny LTX-%s pipeline to %s (seed %d, %d tokens)", version, out_dir, seed, len(tokenizer))
    return out_dir
