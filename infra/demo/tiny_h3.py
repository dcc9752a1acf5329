"""A tiny, offline, deterministic stand-in for the ``MiniMaxAI/MiniMax-H3`` Modular Diffusers repository.

``make_tiny_h3`` writes what latentforge reads of that repository, with the real component classes, saved by
diffusers' own ``MiniMaxH3ModularPipeline.save_pretrained`` so that ``modular_model_index.json`` is the one diffusers
writes (``[library, class, loading spec]`` per component): ``vae/`` (``AutoencoderKLMiniMaxH3``), ``audio_vae/``
(``AutoencoderKLMiniMaxH3Audio``), ``text_encoder/`` (``Qwen3VLForConditionalGeneration``), ``tokenizer/``
(``Qwen2TokenizerFast``) and ``processor/`` (``Qwen3VLProcessor``'s files: its image processor and tokenizer). The
two transformer partitions and the schedulers are named by the index as the real one names them and not written
(nothing here reads them).

The geometry is the real one where it decides a cache's shapes: 24 video latent channels, 16x spatial compression,
``clip_length`` 17 with ``token_drop`` 3 (17n+5 frames → 5n+2 latent frames), ImageNet pixel normalisation, the
video and audio latent statistics of the released checkpoint; a 32 kHz mono audio VAE with hop 800 (40 latents a
second) and 32 latent channels; a Qwen3-VL whose text stack is deep enough for ``hidden_states[50]`` (51 layers).
Every width is tiny, the weights random (fixed seed); the same seed gives byte-identical files. The tokenizer is a
byte-level BPE built offline (no merges) with Qwen's vision markers as special tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from transformers import (
    Qwen2TokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from infra.storage import staged_dir

logger = logging.getLogger(__name__)

#: The released video VAE's latent statistics (DiffSynth-Studio's ``_VIDEO_LATENTS_MEAN`` / ``_VIDEO_LATENTS_STD``,
#: which its pipeline normalises with whatever the checkpoint's config says).
VIDEO_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075, -0.2727581858634949,
    -1.3675414323806763, -0.2553254961967468, -0.26907554268836975, -0.5376840829849243, -0.0464097298681736,
    0.6657370328903198, 0.19690127670764923, -0.5460608005523682, -0.4035342037677765, -0.23683024942874908,
    0.25928452610969543, -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)  # fmt: skip
VIDEO_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.6831774711608887, 1.7549455165863037, 1.5636216402053833,
    2.194143533706665, 0.9653137922286987, 1.0569885969161987, 0.841948926448822, 0.7729952931404114,
    1.8955937623977661, 0.946841835975647, 0.7996809482574463, 0.44988900423049927, 0.7197399735450745,
    0.6936293244361877, 2.961095094680786, 2.7694199085235596, 3.0496184825897217, 2.1088054180145264,
    3.276226282119751, 3.1627357006073, 2.2816812992095947, 2.6127843856811523,
)  # fmt: skip

#: The released audio VAE's latent statistics (DiffSynth-Studio's ``_AUDIO_LATENTS_MEAN`` / ``_AUDIO_LATENTS_STD``).
AUDIO_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373, 0.08179686214561671,
    -0.35782641352446604, 0.040623809960919084, -0.01552534501956604, -0.223362481667332, 0.1821006842509091,
    0.2941778783780663, -0.07901167601970885, -0.056815072777201, -0.3699028221860095, -0.31616315591624855,
    0.5905951377425391, -0.052139568068853864, 0.013673160263486295, -0.03691647864630577, 0.09732660653298163,
    -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344, 0.02868032184767538,
    -0.21217779266454084, -0.1678263169941987, 0.3221287889040614, -0.1223055851554907, 0.4356604928128464,
    -0.0502599202236253, 0.3979258376211797,
)  # fmt: skip
AUDIO_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828, 1.6390226546605453,
    2.7788298348882177, 1.7659090095747236, 1.6199757612137327, 2.6336525640336896, 1.8539356672817833,
    2.5056497896915633, 1.811019237886178, 1.9579657790720237, 1.6685498243529284, 1.4922469314453364,
    3.298670198067373, 1.9491804496832168, 1.8720003270431442, 1.8334080103291832, 1.6488070416529093,
    1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912, 1.8318420762504692,
    1.5540637421583379, 1.9344930328968526, 1.599198216109855, 1.718045989838149, 1.6307219190837705,
    1.8661226051202384, 1.5613768203168363,
)  # fmt: skip

#: The tiny video VAE: the real block layout and factors, narrow channels, a one-layer ViT decoder.
TINY_VAE_CONFIG: dict[str, Any] = {
    "latent_channels": 24,
    "block_out_channels": (8, 8, 8, 16, 16, 16),
    "layers_per_block": 1,
    "spatial_downsample_factors": (2, 2, 2, 2, 1, 1),
    "temporal_downsample_factors": (1, 2, 2, 1, 1, 1),
    "norm_num_groups": 4,
    "decoder_num_layers": 1,
    "decoder_num_attention_heads": 2,
    "decoder_attention_head_dim": 16,
    "decoder_num_register_tokens": 4,
    "clip_length": 17,
    "token_drop": 3,
    "latents_mean": VIDEO_LATENTS_MEAN,
    "latents_std": VIDEO_LATENTS_STD,
}
#: The tiny audio VAE: the real hop (800) and latent width (32), narrow trunks, one AMP block a stage.
TINY_AUDIO_VAE_CONFIG: dict[str, Any] = {
    "encoder_dim": 4,
    "encoder_rates": (2, 4, 4, 5, 5),
    "latent_dim": 64,
    "latent_channels": 32,
    "num_attention_heads": 2,
    "decoder_dim": 128,
    "decoder_rates": (5, 5, 2, 2, 2, 2, 2),
    "decoder_kernel_sizes": (9, 9, 4, 4, 4, 4, 4),
    "resblock_kernel_sizes": (3,),
    "resblock_dilation_sizes": ((1, 3),),
    "sampling_rate": 32000,
}
#: Which hidden state conditions the transformer (diffusers' ``MiniMaxH3ModularPipeline.text_encoder_layer``): the
#: tiny text stack has one layer more, so it is read before the final norm, as the real 64-layer one is.
TEXT_LAYER = 50
TINY_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": TEXT_LAYER + 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [3, 3, 2],
                        "mrope_interleaved": True},
    "max_position_embeddings": 4096,
}  # fmt: skip
TINY_VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0],
}
#: Qwen's special tokens (ids 0-7) the H3 presentations use, before the 256 byte-level characters.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
)
#: The components a Modular H3 index names that the tiny repository does not hold (as the real index names them).
NOT_WRITTEN = {
    "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"],
    "transformer_ref": ["diffusers", "MiniMaxH3Transformer3DModel"],
    "scheduler": ["diffusers", "MiniMaxH3Scheduler"],
    "audio_scheduler": ["diffusers", "MiniMaxH3Scheduler"],
    "processor": ["transformers", "Qwen3VLProcessor"],
}
_SEEDS = {"vae": 1, "audio_vae": 2, "text_encoder": 3}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (the byte-level alphabet Qwen's tokenizer spells text in)."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = kept[:], 0
    for byte in range(256):
        if byte not in kept:
            kept.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(kept, chars, strict=True)}


def build_tokenizer() -> Qwen2TokenizerFast:
    """A byte-level BPE without merges (every byte a token) with Qwen's special tokens: a ``Qwen2TokenizerFast``."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in _bytes_to_unicode().values():
        vocab.setdefault(char, len(vocab))
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=[], unk_token=None, pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def _text_encoder(seed: int, tokenizer: Qwen2TokenizerFast) -> Qwen3VLForConditionalGeneration:
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config={**TINY_TEXT_CONFIG, "vocab_size": len(tokenizer)},
        vision_config=TINY_VISION_CONFIG,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(1000 * seed + _SEEDS["text_encoder"])
    return Qwen3VLForConditionalGeneration(config).eval()


def _write_processor(folder: Path, tokenizer: Qwen2TokenizerFast) -> None:
    """``processor/``: the Qwen3-VL image processor's config (its PIL backend: this environment has no torchvision,
    which the video processor needs, so no ``Qwen3VLProcessor`` object is built here) and the tokenizer's files,
    as the real folder holds them. A t2va prompt reads the tokenizer only."""
    image = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    image.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def make_tiny_h3(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Write a tiny MiniMax-H3 Modular repository (the VAEs, the Qwen3-VL conditioner, its tokenizer and processor)
    into ``out_dir``, which must be absent or empty. ``tokenizer_dir``: a local Qwen2 tokenizer folder in place of
    the built one (the conditioner's vocabulary is sized to it). Built in a sibling folder and moved into place; the
    caller's torch RNG state is left as it was. Returns ``out_dir``."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks  # noqa: PLC0415 - heavy: the modular blocks

    out_dir = Path(out_dir)
    with staged_dir(out_dir, "the tiny MiniMax-H3 repository") as staging, torch.random.fork_rng(devices=[]):
        tokenizer = build_tokenizer() if tokenizer_dir is None else Qwen2TokenizerFast.from_pretrained(tokenizer_dir)
        torch.manual_seed(1000 * seed + _SEEDS["vae"])
        vae = AutoencoderKLMiniMaxH3(**TINY_VAE_CONFIG).eval()
        torch.manual_seed(1000 * seed + _SEEDS["audio_vae"])
        audio_vae = AutoencoderKLMiniMaxH3Audio(
            **TINY_AUDIO_VAE_CONFIG, latents_mean=list(AUDIO_LATENTS_MEAN), latents_std=list(AUDIO_LATENTS_STD)
        ).eval()
        pipe = MiniMaxH3Blocks().init_pipeline()
        pipe.update_components(
            vae=vae,
            audio_vae=audio_vae,
            text_encoder=_text_encoder(seed, tokenizer),
            tokenizer=tokenizer,
        )
        pipe.save_pretrained(str(staging), overwrite_modular_index=True)
        _write_processor(staging / "processor", tokenizer)
        _name_the_rest(staging / "modular_model_index.json")
    logger.info("wrote tiny MiniMax-H3 repository to %s (seed %d, %d tokens)", out_dir, seed, len(tokenizer))
    return out_dir


def _name_the_rest(index_path: Path) -> None:
    """The index written with local paths for what was saved (diffusers' own), the rest named as the real one."""
    index = json.loads(index_path.read_text(encoding="utf-8"))
    for name, (library, cls) in NOT_WRITTEN.items():
        spec = {"pretrained_model_name_or_path": "MiniMaxAI/MiniMax-H3", "subfolder": name, "type_hint": [library, cls]}
        if not isinstance(index.get(name), list) or index[name][0] is None:
            index[name] = [library, cls, spec]
    for entry in index.values():  # a local staging path would differ per run: the folder's own name instead
        spec = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) else {}
        if Path(str(spec.get("pretrained_model_name_or_path") or "")).is_absolute():
            spec["pretrained_model_name_or_path"] = "."
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
