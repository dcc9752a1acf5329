"""Named recipes: the settings that reproduce a cache as a known trainer or published dataset makes it.

`--recipe NAME` sets them; a config file and flags override any of them (`apply_recipe`, which the plan and the
commands apply: a BuildConfig holds the name, not the settings, until then). The fingerprint covers the resolved
settings, not the name (two spellings of one recipe are one cache); cache.json's provenance records the name and
`inspect` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infra.config import BuildConfig
from infra.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    settings: dict[str, Any] = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "wan22-vbvr",
            "The published Wan2.2 VBVR cache, bit for bit: 33 frames spanning the clip, stretched to 832x832 "
            "(bilinear), UMT5 padded to 512 with the encoder's raw outputs at pad positions, per-sample .pt",
            {
                "family": "wan22",
                "format": "pt",
                "frames": 33,
                "height": 832,
                "width": 832,
                "temporal": "span",
                "resize": "stretch",
                "text_max_length": 512,
                "text_padding": "raw",
            },
        ),
        Recipe(
            "ltx2-trainer",
            "What the LTX-2 trainer's process_dataset.py writes: the first F frames, bicubic cover + centre crop, "
            "Gemma pre-connector text padded to 1024, audio latents of every clip with an audio track (--skip-audio: "
            "none), the .precomputed/ layout (give --buckets or F/H/W)",
            {
                "family": "ltx2",
                "format": "ltx",
                "audio": True,
                "audio_file_length": "trainer",
                "temporal": "head",
                "resize": "cover-crop",
                "text_stage": "pre_connector",
                "text_max_length": 1024,
            },
        ),
        Recipe(
            "fastvideo-ltx2",
            "FastVideo's LTX-2 training data: frames resampled to 24 fps, bilinear antialiased cover + centre "
            "crop, post-connector text, parquet (FastVideo's t2v schema, float32 bytes)",
            {
                "family": "ltx2",
                "format": "parquet",
                "temporal": "fps:24",
                "resize": "cover-crop-aa",
                "text_stage": "post_connector",
                "text_max_length": 1024,
            },
        ),
        Recipe(
            "wan22-context",
            "World-model context windows for Wan2.2: every non-overlapping window of 29 frames at stride 2 "
            "(8 latent slots), each its own sample ID@FIRST, stretched, raw text padding",
            {
                "family": "wan22",
                "format": "pt",
                "frames": 29,
                "temporal": "windows:2",
                "resize": "stretch",
                "text_padding": "raw",
            },
        ),
        Recipe(
            "musubi-wan",
            "musubi-tuner's Wan cache (Wan2.1, Wan2.2-A14B; family wan21): the first F frames, each clip bucketed as "
            "musubi's BucketSelector recomputes it from its size (--width/--height: its resolution), resized as its "
            "resize_image_to_bucket does (LANCZOS up, INTER_AREA down), prompts cleaned as its tokenizer does, "
            "musubi's names, keys and dataset TOML (--mode i2v: its latents_image and CLIP features)",
            {"format": "musubi", "frames": 81, "height": 480, "width": 832, "temporal": "head"},
        ),
        Recipe(
            "hv15-musubi",
            "musubi-tuner's HunyuanVideo 1.5 cache (hv_1_5_cache_latents.py, hv_1_5_cache_text_encoder_outputs.py; "
            "family hv15): the first F frames, each clip bucketed and resized as musubi's resize_image_to_bucket does, "
            "the raw VAE posterior mode tiled as its default --vae_sample_size 128 tiles, the prompt in its video "
            "template through Qwen2.5-VL (3rd last layer, template cropped) and its quoted text through ByT5, "
            "musubi's _hv15 names, keys and dataset TOML",
            {
                "family": "hv15",
                "format": "musubi",
                "frames": 121,
                "height": 480,
                "width": 848,
                "temporal": "head",
                "text_padding": "zeros",
                "vae_tiling": True,
            },
        ),
        Recipe(
            "diffsynth-wan",
            "DiffSynth-Studio's split-training files for Wan (Wan2.1, Wan2.2-A14B: wan21; Wan2.2-TI2V-5B: wan22): the "
            "first F frames, resized as its ImageCropAndResize does (PIL bilinear, rounded cover and crop), turned "
            "upright as its ffmpeg reader turns them, prompts cleaned as its tokenizer does, UMT5 zero-padded to 512 "
            "(--mode i2v: y and clip_feature, or TI2V-5B's first_frame_latents)",
            {"format": "diffsynth", "temporal": "head", "text_padding": "zeros"},
        ),
        Recipe(
            "image-512",
            "One image per sample at 512x512 (the image family): EXIF orientation applied, RGB over white, then "
            "torchvision's Resize(512, BICUBIC) + CenterCrop(512) + Normalize(0.5, 0.5) on the PIL image, bf16",
            {
                "family": "image",
                "frames": 1,
                "height": 512,
                "width": 512,
                "temporal": "head",
                "resize": "torchvision",
                "store_dtype": "bf16",
            },
        ),
        Recipe(
            "cc12m-wds",
            "The CC12M latent set's webdataset layout: one image per sample at 512x512 (torchvision's Resize(512, "
            "BICUBIC) + CenterCrop(512) + Normalize(0.5, 0.5), as the seed preprocesses), float16 latents as "
            "shards/00000.tar ... (one part per numbered source shard), members <key>.npy + <key>.txt only, "
            "_meta.json with the exact sample count (a model without a text encoder)",
            {
                "family": "image",
                "format": "webdataset",
                "layout": "cc12m",
                "frames": 1,
                "height": 512,
                "width": 512,
                "temporal": "head",
                "resize": "torchvision",
                "store_dtype": "fp16",
            },
        ),
        Recipe(
            "qwen-image-musubi",
            "musubi-tuner's Qwen-Image cache (qwen_image_cache_latents.py, qwen_image_cache_text_encoder_outputs.py): "
            "each image bucketed as its BucketSelector recomputes it from the image's size (--width/--height: its "
            "resolution), read and resized as its image dataset does (no EXIF turn, LANCZOS up, INTER_AREA down), "
            "Qwen2.5-VL's caption rows past the template's 34, up to 1024 tokens, its qi names, keys and dataset TOML",
            {
                "family": "qwen-image",
                "format": "musubi",
                "frames": 1,
                "height": 1024,
                "width": 1024,
                "temporal": "head",
                "resize": "musubi",
                "text_max_length": 1024,
                "text_padding": "zeros",
            },
        ),
        Recipe(
            "qwen-image-diffsynth",
            "DiffSynth-Studio's split-training files for Qwen-Image (its --height/--width mode): each image read and "
            "cropped as its LoadImage and ImageCropAndResize do (PIL bilinear, rounded cover and crop), input_latents, "
            "Qwen2.5-VL's caption rows past the template's 34 (prompt_emb and its mask), up to 4096 tokens as its "
            "PromptEmbedder takes them",
            {
                "family": "qwen-image",
                "format": "diffsynth",
                "frames": 1,
                "height": 1024,
                "width": 1024,
                "temporal": "head",
                "resize": "diffsynth",
                "text_max_length": 4096,
                "text_padding": "zeros",
            },
        ),
        Recipe(
            "h3-fastvideo",
            "FastVideo's MiniMax-H3 t2va rows (preprocess_minimax_h3_overfit): the clip on H3's 24 fps timeline and "
            "its first 124 frames, each stretched to 768x1344 by Pillow's LANCZOS, the video VAE's posterior sampled "
            "under seed 42, Qwen3-VL hidden_states[50] of the bare prompt, the stereo track at 32 kHz through the "
            "audio VAE, FastVideo's t2va parquet schema in float32 bytes",
            {
                "family": "h3",
                "format": "parquet",
                "audio": True,
                "frames": 124,
                "height": 768,
                "width": 1344,
                "temporal": "resample:24",
                "resize": "h3-lanczos",
                "store_dtype": "fp32",
                "text_max_length": 1024,
            },
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`; ConfigError listing the known ones."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)} (`latentforge recipes` lists them)")
    return RECIPES[name]


def with_recipe(values: dict[str, Any]) -> dict[str, Any]:
    """Flat `values` (config file and flags, merged) over the settings of the recipe they name, if any (a value left
    None does not unset a recipe's setting): for a step that lays these values over OUT's own cache.json."""
    name = values.get("recipe")
    if not name:
        return dict(values)
    return {**get_recipe(name).settings, **{k: v for k, v in values.items() if v is not None}}


def apply_recipe(config: BuildConfig) -> BuildConfig:
    """`config` over the settings of the recipe it names, if any: a setting given (in the file, a flag or the form)
    wins, a recipe's fills what was not given. Applying it again changes nothing. ConfigError for an unknown name."""
    return BuildConfig.model_validate(with_recipe(config.given())) if config.recipe else config
