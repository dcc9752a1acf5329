"""Which trainer reads what: per format and family, the consumer a cache is written for and what it expects.

A format is written for a consumer, and that consumer's own loader must hand its trainer the tensors its own
preprocessing would have made (DESIGN invariant 7). `CONSUMERS` says, per (format, family), what that is: latent
normalisation, which text rows and on which side the padding is, the text stage, the dtype on disk and what
``fps`` means. `check_consumer` refuses at plan time a combination no consumer reads correctly, naming the
consumer and what it would misread; `latent_norm_for` is the normalisation the spec records.

The table is docs/formats.md's "Which trainer reads what" (keep the two in step; tests/test_wan_consumers.py checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infra.errors import ConfigError
from infra.formats.shards import cc12m_names
from infra.media import text_clean

#: What the spec's ``latent_norm`` says for latents stored as the raw posterior mean (FastVideo's Wan2.2 parquet).
RAW_MEAN = "posterior.mean, raw: the consumer applies (x - latents_mean) / latents_std at training time"
#: ... and for a posterior sample under a fixed seed, normalised (FastVideo's MiniMax-H3 parquet).
SAMPLED = (
    "posterior sample, mean + std * randn(CPU generator seeded 42, one per clip), then (z - latents_mean) / latents_std"
)
FASTVIDEO = "FastVideo 0.2.1 (fastvideo/dataset/utils.py collate)"
MUSUBI = "kohya-ss/musubi-tuner (commit 30c658c: wan_train_network.py)"
MUSUBI_HV15 = "kohya-ss/musubi-tuner (commit 30c658c: hv_1_5_train_network.py)"
DIFFSYNTH = "DiffSynth-Studio split training (diffsynth 2.1.12: --task sft:train on its data_process files)"


@dataclass(frozen=True)
class Expects:
    """What one consumer reads from one format for one family."""

    consumer: str
    latents: str  # "normalised" (the family's latent_norm), "raw_mean" (RAW_MEAN: normalised by the consumer) or
    # "sampled" (SAMPLED: the consumer caches a seeded posterior sample)
    text_rows: str  # "all" (every row, padded to max_length) or "prompt" (the prompt's tokens only)
    padding_side: str  # where the family's tokenizer pads: "right", "left", or "-" (no text)
    text_stage: str  # the text tensor stored (last_hidden_state, pre_connector, post_connector)
    dtype_on_disk: str
    fps: str  # what a stored fps means ("-": none stored)
    #: setting → (the value refused, why the consumer misreads it)
    refuses: tuple[tuple[str, str, str], ...] = ()
    #: the cleaning its tokenizer applies to a prompt first (`infra.media.text_clean`), the spec's ``text_clean``
    text_clean: str | None = None
    #: its own preprocessing's resize policy (`infra.media.resize`), the spec's ``resize`` unless ``--resize`` is
    #: given (None: the family's default, no consumer's arithmetic is matched)
    resize: str | None = None
    #: what its own video reader gives of a clip with a display matrix: ``stored`` (PyAV, decord: the frames as
    #: stored) or ``auto`` (the ffmpeg program's autorotate: upright), the spec's ``rotate`` unless ``--rotate``
    rotate: str = "stored"
    #: whether its files carry the timestep range its training step draws from (``--max/min-timestep-boundary``)
    timestep_boundaries: bool = False
    #: the parquet schema its reader collates: FastVideo's ``pyarrow_schema_t2v``, or ``pyarrow_schema_t2va`` (video,
    #: stereo audio and text, `infra.formats.parquet_t2va`)
    parquet_schema: str = "pyarrow_schema_t2v"


#: FastVideo's parquet schema with an audio column (MiniMax-H3's rows).
AUDIO_SCHEMA = "pyarrow_schema_t2va"
_LATENTFORGE = "latentforge's readers (infra.formats; no outside trainer is matched)"
_WIDENED = "float32 .npy (bf16 widened)"
_EFFECTIVE = "the rate of the frames stored (fps:N gives N; otherwise native / the mean index step)"

CONSUMERS: dict[tuple[str, str], Expects] = {
    ("pt", "wan22"): Expects(
        "Wan2.2 trainers of the VBVR cache (the seed recipe)",
        "normalised",
        "all",
        "right",
        "last_hidden_state",
        "bf16 (.pt)",
        "-",
    ),
    ("pt", "ltx2"): Expects(_LATENTFORGE, "normalised", "all", "left", "pre_connector", "bf16 (.pt)", "-"),
    ("pt", "image"): Expects(_LATENTFORGE, "normalised", "all", "right", "last_hidden_state", "bf16|fp16 (.pt)", "-"),
    ("ltx", "ltx2"): Expects(
        "LTX-2 ltx-trainer (PrecomputedDataset)",
        "normalised",
        "all",
        "left",
        "pre_connector",
        "bf16 (.pt; audio float32)",
        "the rate of the frames stored (head: the stream's; every K-th frame: native / K, as the trainer's "
        "temporal_subsample_factor; fps:N gives N)",
        (
            (
                "text_stage",
                "post_connector",
                "the trainer runs the connectors on what it loads: post-connector "
                "embeddings would go through them twice",
            ),
        ),
        resize="cover-crop",
    ),
    ("parquet", "wan22"): Expects(
        FASTVIDEO + ", WanModel",
        "raw_mean",
        "prompt",
        "right",
        "last_hidden_state",
        "float32 bytes",
        _EFFECTIVE,
    ),
    ("parquet", "ltx2"): Expects(
        FASTVIDEO + ", LTX2Model",
        "normalised",
        "all",
        "left",
        "post_connector",
        "float32 bytes",
        _EFFECTIVE + "; it feeds the RoPE",
        (
            (
                "text_stage",
                "pre_connector",
                "LTX2Model runs no connector and passes no attention mask: it would "
                "train on pre-connector features and their left pad rows as if they were connector outputs (use "
                "--text-stage post_connector, the fastvideo-ltx2 recipe, or --format ltx for the LTX-2 trainer)",
            ),
        ),
    ),
    ("parquet", "image"): Expects(
        "pyarrow / datasets readers (FastVideo trains no model of this family)",
        "normalised",
        "prompt",
        "right",
        "last_hidden_state",
        "float32 bytes",
        "-",
    ),
    ("pt", "wan21"): Expects(_LATENTFORGE, "normalised", "all", "right", "last_hidden_state", "bf16 (.pt)", "-"),
    ("musubi", "wan21"): Expects(
        MUSUBI + ", its BucketBatchManager",
        "normalised",
        "prompt",
        "right",
        "last_hidden_state",
        "bf16 safetensors (CLIP features float16)",
        "-",
        text_clean="whitespace",
        resize="musubi",
    ),
    **{
        ("diffsynth", family): Expects(
            DIFFSYNTH + ", WanVideoPipeline",
            "normalised",
            "all",
            "right",
            "last_hidden_state",
            "bf16 .pth (a pickle its trainer loads with weights_only=False)",
            "-",
            (
                (
                    "text_padding",
                    "raw",
                    "its PromptEmbedder zeroes every row past the prompt's tokens, and its training step uses the "
                    "context as stored: use --text-padding zeros (the diffsynth-wan recipe)",
                ),
            ),
            text_clean="whitespace",
            resize="diffsynth",
            rotate="auto",  # its LoadVideo reads through imageio's ffmpeg program, which turns a clip upright
            timestep_boundaries=True,
        )
        for family in ("wan21", "wan22")
    },
    ("parquet", "h3"): Expects(
        FASTVIDEO + ", MiniMaxH3Model (pyarrow_schema_t2va)",
        "sampled",
        "prompt",
        "right",
        "hidden_states_50",
        "float32 bytes",
        "24: the frames on H3's 24 fps timeline (resample:24)",
        (
            (
                "store_dtype",
                "bf16",
                "its preprocessing stores the float32 VAE sample and the conditioner's output widened to float32: "
                "bf16 would round the latents (use --store-dtype fp32, the h3-fastvideo recipe)",
            ),
        ),
        resize="h3-lanczos",
        parquet_schema="pyarrow_schema_t2va",
    ),
    ("musubi", "hv15"): Expects(
        MUSUBI_HV15 + ", its BucketBatchManager",
        "normalised",
        "prompt",
        "right",
        "hidden_states[-3]",
        "safetensors: latents and Qwen2.5-VL rows in --store-dtype, ByT5 glyph rows float16",
        "-",
        resize="musubi",
    ),
    ("webdataset", "wan22"): Expects(
        "webdataset.WebDataset readers",
        "normalised",
        "all",
        "right",
        "last_hidden_state",
        _WIDENED,
        _EFFECTIVE + " (json member)",
    ),
    ("webdataset", "ltx2"): Expects(
        "webdataset.WebDataset readers",
        "normalised",
        "all",
        "left",
        "pre_connector",
        _WIDENED,
        _EFFECTIVE + " (json member)",
    ),
    ("webdataset", "image"): Expects(
        "webdataset.WebDataset readers; the CC12M latent layout (--recipe cc12m-wds)",
        "normalised",
        "all",
        "right",
        "last_hidden_state",
        "float16 .npy with --store-dtype fp16, else float32",
        "-",
        resize="torchvision",
    ),
    ("musubi", "qwen-image"): Expects(
        "kohya-ss/musubi-tuner (commit 30c658c: qwen_image_train_network.py), its BucketBatchManager",
        "normalised",
        "prompt",
        "right",
        "last_hidden_state",
        "bf16 safetensors",
        "-",
        resize="musubi",
    ),
    ("diffsynth", "qwen-image"): Expects(
        DIFFSYNTH + ", QwenImagePipeline",
        "normalised",
        "prompt",
        "right",
        "last_hidden_state",
        "bf16 .pth (a pickle its trainer loads with weights_only=False)",
        "-",
        resize="diffsynth",
    ),
}


#: Formats written for one trainer only: the families it trains (any other is refused at the plan), and in words.
ONLY_FOR: dict[str, tuple[tuple[str, ...], str]] = {
    "musubi": (
        ("wan21", "qwen-image", "hv15"),
        f"{MUSUBI} caches Wan2.1 and Wan2.2-A14B (family wan21), Qwen-Image (qwen-image) and HunyuanVideo 1.5 (hv15), "
        "not Wan2.2-TI2V-5B",
    ),
    "diffsynth": (
        ("wan21", "wan22", "qwen-image"),
        f"{DIFFSYNTH}: these files are its Wan pipeline's (families wan21, wan22) or Qwen-Image's (qwen-image)",
    ),
}


#: (format, family) → why no trainer reads that family in that format, though the format takes other families.
NO_TRAINER: dict[tuple[str, str], str] = {
    ("parquet", "hv15"): "FastVideo 0.2.1 trains no HunyuanVideo 1.5 (its HunyuanModel is v1's "
    "HunyuanVideoTransformer3DModel, its preprocess_hunyuan_overfit.py v1's LLaMA + CLIP text; its 1.5 pipelines are "
    "for inference); use --format musubi (the hv15-musubi recipe)",
}


def refuse_unread(fmt: str, family: str) -> None:
    """ConfigError for a format and family no trainer reads together (`NO_TRAINER`), before the plan looks further."""
    if (why := NO_TRAINER.get((fmt, family))) is not None:
        raise ConfigError(f"format {fmt} with family {family}: {why}; no trainer reads it")


def expects(fmt: str, family: str) -> Expects | None:
    """What the consumer of `fmt` reads for `family` (None: a plugin family, read by latentforge's readers)."""
    return CONSUMERS.get((fmt, family))


def latent_norm_for(fmt: str, family: str, family_norm: str) -> str:
    """The normalisation the spec records for `family` in `fmt`: the family's own, or `RAW_MEAN` where the consumer
    normalises at training time (so the two caches have different fingerprints)."""
    found = expects(fmt, family)
    own = {"raw_mean": RAW_MEAN, "sampled": SAMPLED}
    return own.get(found.latents, family_norm) if found is not None else family_norm


def check_consumer(spec: Any, kinds: Sequence[str] = ()) -> None:
    """ConfigError when no consumer of the spec's format reads its family's tensors correctly, naming the consumer
    and what it would misread (`kinds`: the output kinds each sample holds)."""
    if spec.layout == "cc12m" and set(kinds) - {"latents"}:
        raise ConfigError(
            f"--layout cc12m stores <key>.npy (the latents) and <key>.txt (the caption) only, as the CC12M latent set "
            f"does: this model also makes {', '.join(k for k in kinds if k != 'latents')}; use a model without a "
            "text encoder (make-tiny-model --text none) or the default layout"
        )
    if spec.layout == "cc12m" and spec.store_dtype != "fp16":
        raise ConfigError(
            "--layout cc12m stores float16 .npy latents, as the CC12M latent set does: use --store-dtype fp16 (a "
            "family that stores float16: image)"
        )
    refuse_unread(spec.format, spec.family)
    families, trains = ONLY_FOR.get(spec.format, ((spec.family,), ""))
    if spec.family not in families:
        raise ConfigError(f"format {spec.format} with family {spec.family}: {trains}; no trainer reads it")
    text_clean.require(getattr(spec, "text_clean", None))
    found = expects(spec.format, spec.family)
    check_boundaries(spec, found)
    if spec.format == "parquet" and "audio_latents" in kinds and getattr(found, "parquet_schema", "") != AUDIO_SCHEMA:
        raise ConfigError(
            f"format parquet with family {spec.family}: FastVideo's pyarrow_schema_t2v has no audio column (its "
            f"{AUDIO_SCHEMA} is MiniMax-H3's): drop --audio (--skip-audio), or use a format with audio (ltx)"
        )
    if found is None:
        return
    for setting, value, why in found.refuses:
        if getattr(spec, setting, None) == value:
            flag = "--text-stage" if setting == "text_stage" else f"--{setting.replace('_', '-')}"
            raise ConfigError(
                f"format {spec.format} with family {spec.family} and {flag} {value}: its consumer, {found.consumer}, "
                f"would misread it: {why}"
            )
    if found.latents == "raw_mean" and spec.latent_norm != RAW_MEAN:
        raise ConfigError(f"format {spec.format} with family {spec.family}: {found.consumer} expects {RAW_MEAN}")
    if found.latents == "sampled" and spec.latent_norm != SAMPLED:
        raise ConfigError(f"format {spec.format} with family {spec.family}: {found.consumer} expects {SAMPLED}")


def preprocessing_for(fmt: str, family: str) -> dict[str, str]:
    """The settings the consumer of `fmt` declares for `family`'s pixels, where it declares them (``resize``, the
    resize policy; ``rotate``, what its reader gives of a rotated clip): the defaults a user's flag overrides."""
    found = expects(fmt, family)
    if found is None:
        return {}
    return {"rotate": found.rotate} | ({"resize": found.resize} if found.resize is not None else {})


def check_boundaries(spec: Any, found: Expects | None) -> None:
    """ConfigError for a timestep range no file of the format carries, or one that is empty."""
    top, bottom = getattr(spec, "max_timestep_boundary", 1.0), getattr(spec, "min_timestep_boundary", 0.0)
    if (top, bottom) == (1.0, 0.0):
        return
    if found is None or not found.timestep_boundaries:
        raise ConfigError(
            f"--max/--min-timestep-boundary: format {spec.format} stores no timestep range (DiffSynth-Studio's split "
            "training files do: --format diffsynth)"
        )
    if bottom >= top:
        raise ConfigError(f"--min-timestep-boundary {bottom} is not below --max-timestep-boundary {top}")


def text_clean_for(fmt: str, family: str) -> str | None:
    """The cleaning the consumer of `fmt` applies to `family`'s prompts before its tokenizer (the spec's
    ``text_clean``), or None."""
    found = expects(fmt, family)
    return found.text_clean if found is not None else None


def keeps_all_text_rows(fmt: str, family: str) -> bool:
    """Whether the consumer reads every text row (padded to max_length) rather than the prompt's tokens only."""
    found = expects(fmt, family)
    return found is None or found.text_rows == "all"


def stores_raw_mean(spec: Any) -> bool:
    """Whether the spec stores latents as the raw posterior mean."""
    return getattr(spec, "latent_norm", None) == RAW_MEAN


def stored_fps(temporal: str | None, info: dict[str, Any]) -> float:
    """The rate of the frames a sample stores: N under ``fps:N`` and ``resample:N`` (the rate the frames were
    resampled to, as FastVideo records it), else the sampled frames' effective rate (native / the mean index step),
    else the stream's rate; 0.0 when none is known (a still)."""
    if temporal and temporal.startswith(("fps:", "resample:")):
        return float(temporal.split(":", 1)[1])
    sampling = info.get("sampling") or {}
    return float(sampling.get("fps") or info.get("fps") or 0.0)


class RawMeanEncoder:
    """A loaded family seen through a consumer that normalises latents itself: `encode_videos` gives the raw
    posterior mean in float32 (the caller casts to the stored dtype), so no bf16 rounding of the normalised value
    is undone. The family must have ``encode_raw_videos`` (wan22)."""

    def __init__(self, loaded: Any) -> None:
        if not callable(getattr(loaded, "encode_raw_videos", None)):
            raise ConfigError(f"family {loaded.name} cannot give raw posterior means (no encode_raw_videos)")
        self.loaded = loaded
        self.name = loaded.name

    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.loaded.encode_raw_videos(pixels)


class SampledEncoder:
    """A loaded family seen through a consumer that caches a posterior sample (`SAMPLED`): `encode_videos` gives the
    family's ``encode_sampled_videos`` (h3)."""

    def __init__(self, loaded: Any) -> None:
        if not callable(getattr(loaded, "encode_sampled_videos", None)):
            raise ConfigError(f"family {loaded.name} cannot give posterior samples (no encode_sampled_videos)")
        self.loaded = loaded
        self.name = loaded.name

    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.loaded.encode_sampled_videos(pixels)


def latent_encoder(encoder: Any, spec: Any) -> Any:
    """The encoder whose ``encode_videos`` gives the latents the spec stores (the family's, its raw mean, or its
    seeded posterior sample)."""
    if getattr(spec, "latent_norm", None) == SAMPLED:
        return SampledEncoder(encoder)
    return RawMeanEncoder(encoder) if stores_raw_mean(spec) else encoder


def normalised(latents: torch.Tensor, spec: Any, family: Any) -> torch.Tensor:
    """Stored latents as the family's decoder takes them: raw means normalised with the loaded family's own
    ``normalise`` (decode-and-verify of a FastVideo Wan2.2 cache), others as they are."""
    return family.normalise(latents) if stores_raw_mean(spec) else latents


#: Formats whose bytes follow one consumer's layout, always: the spec's ``layout`` (musubi's also picks its buckets,
#: `infra.media.buckets.BUCKET_RULES`).
LAYOUTS = {"parquet": "fastvideo", "musubi": "musubi"}


def layout_for(config: Any) -> str | None:
    """The spec's ``layout``: ``fastvideo`` for parquet (its rows follow FastVideo's preprocessing), ``musubi`` for
    musubi (its names and buckets), ``cc12m`` for a webdataset asked for the CC12M seed's layout, else None
    (latentforge's own; left out of the fingerprint)."""
    asked = config.encoding.layout
    if asked == "cc12m" and config.encoding.format != "webdataset":
        raise ConfigError(
            f"--layout cc12m is a webdataset layout (the CC12M latent set): not for --format {config.encoding.format}"
        )
    if config.encoding.format in LAYOUTS:
        return LAYOUTS[config.encoding.format]
    return "cc12m" if asked == "cc12m" else None


def layout_notes(spec: Any, shards: list[Any]) -> list[str]:
    """What the plan says of the spec's layout's part names (ConfigError where the layout cannot name them)."""
    if spec.layout != "cc12m":
        return []
    return cc12m_names(shards, spec.shard_samples)


def written_for(spec: dict[str, Any]) -> dict[str, Any]:
    """Which consumer a cache (its cache.json ``spec``) was written for, and what that consumer sees: latents
    normalised or the raw mean, which text rows and stage, the dtype on disk, what fps means; ``layout`` where the
    cache follows a consumer's layout (fastvideo, cc12m)."""
    found = expects(str(spec.get("format")), str(spec.get("family")))
    stage = spec.get("text_stage", "last_hidden_state")
    if found is None:
        return {"consumer": _LATENTFORGE, "latents": "normalised", "text_stage": stage}
    return {
        "consumer": found.consumer,
        "latents": "raw_mean" if spec.get("latent_norm") == RAW_MEAN else "normalised",
        "text_rows": found.text_rows,
        "padding_side": found.padding_side,
        "text_stage": stage,
        "dtype_on_disk": found.dtype_on_disk,
        "fps": found.fps,
        **({"layout": spec["layout"]} if spec.get("layout") else {}),
    }
