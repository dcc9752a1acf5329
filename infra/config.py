"""Typed configuration: the run options (BuildConfig) and the cache's identity (CacheSpec).

BuildConfig is what a user gives (YAML file, CLI flags, Prefect form), in sections: what decides the bytes
(`EncodingConfig`), what is selected, limits, gates and approvals, how the run goes, publish, alerts. A config
file and the flags stay flat (``frames: 33``, ``--on-loss accept``): each key is sorted into its section (the
nested form is accepted too). CacheSpec is the part that decides the bytes of the cache, under the config's names;
its fingerprint is written to ``cache.json`` and into every sample, and a resume is allowed only when
fingerprints match. Run options that do not change bytes (device, limits, workers) stay out of the spec.

This module is the ground floor: it imports nothing of the project but `infra.errors`. Checks that need more
(the recipe, the upload target, Ray installed) are made where the config is used (`infra.recipes.apply_recipe`,
`flows.settings.resolve_config`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined

from infra.bounds import (
    MAX_BYTES,
    MAX_COUNT,
    MAX_FPS,
    MAX_FRAMES,
    MAX_MB,
    MAX_SECONDS,
    MAX_SIDE,
    MAX_TEXT_TOKENS,
    bucket_sizes,
    check_geometry,
    seconds_list,
    text_problem,
)
from infra.errors import ConfigError, QuantizeOffCpu
from infra.urls import secret_in, url_problem

#: Bump when the meaning of a spec field or the stored layout changes: old caches stop matching.
SPEC_VERSION = 1

Device = Literal["auto", "cpu", "cuda", "neuron"]
ComputeDtype = Literal["bf16", "fp32"]
StoreDtype = Literal["bf16", "fp16", "fp32"]
OnConflict = Literal["ask", "abort", "new_dir", "reuse"]
#: The modes (`--mode`) the families declare (`infra.models.base.FamilySpec.mode_roles`; LTX-2's:
#: `infra.models.ltx2_modes`): each decides which roles a sample reads and which output kinds it holds.
Mode = Literal[
    "t2v", "i2v", "t2a", "v2v-ic-lora", "av2av-ic-lora", "a2a-ic-lora", "a2v", "v2a", "video-inpaint", "audio-inpaint"
]  # fmt: skip

#: A temporal policy's spelling (`infra.media.temporal` makes the policy): span, head, fps:N, stride:K, windows:K;
#: ``linspace`` is latentforge 0.1's name for span.
_TEMPORAL = re.compile(r"^(span|head|linspace)$|^(fps|resample):(\d+(?:\.\d+)?)$|^(stride|windows):(\d+)$")
TEMPORAL_ALIASES = {"linspace": "span"}


def parse_temporal(text: str) -> tuple[str, float]:
    """``"fps:24"`` → ("fps", 24.0); ConfigError with the accepted forms."""
    m = _TEMPORAL.match(text.strip())
    if not m:
        raise ConfigError(f"--temporal {text!r}: expected span, head, fps:N, resample:N, stride:K or windows:K")
    if m.group(1):
        return TEMPORAL_ALIASES.get(m.group(1), m.group(1)), 0.0
    kind, value = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
    if float(value) <= 0:
        raise ConfigError(f"--temporal {text!r}: {kind} needs a positive number")
    bound = MAX_FPS if kind in ("fps", "resample") else MAX_COUNT
    if float(value) > bound:
        raise ConfigError(f"--temporal {text[:80]!r}: {kind} over the bound of {bound:g}")
    return kind, float(value)


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``frames: yes`` is not 1 frame: a number setting refuses true/false (pydantic's lax mode takes it)."""
        annotation = cls.model_fields[str(info.field_name)].annotation
        kinds = typing.get_args(annotation) or (annotation,)
        if isinstance(value, bool) and bool not in kinds and {int, float} & set(kinds):
            raise ValueError(f"{value!r} is true/false, not a number")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _text_is_text(cls, value: Any) -> Any:
        """Every string setting, alone or in a list: no NUL, UTF-8 text, not absurdly long (`text_problem`)."""
        for text in [value] if isinstance(value, str) else value if isinstance(value, list | tuple) else []:
            if isinstance(text, str) and (problem := text_problem(text)):
                raise ValueError(problem)
        return value


class UploadConfig(StrictModel):
    """Where and how a finished cache is published (`latentforge upload`, or the build's last step)."""

    to: str = Field(description="hf://datasets/ORG/NAME[@revision][/path] or s3://BUCKET/PREFIX")
    include: list[str] = Field(default_factory=list, description="Only OUT-relative paths matching one of these globs")
    exclude: list[str] = Field(default_factory=list, description="Leave out paths matching any of these globs")
    skip_gates: bool = Field(
        False, description="Upload even when the latest run report does not show the gates passed (logged)"
    )
    approve_replace: str | None = Field(
        None, description="Token printed by a refused upload, bound to the target and the remote files it replaces"
    )

    @field_validator("to")
    @classmethod
    def _no_credentials_in_the_target(cls, value: str) -> str:
        return checked_url(value)

    on_conflict: Literal["ask", "abort"] | None = Field(
        None,
        description="When a remote file differs from ours: ask (pause for a person) or abort. "
        "Default: ask on a Prefect server, else abort. Replacing is never a standing setting: see approve_replace.",
    )
    workers: int = Field(8, ge=1, le=64, description="Parallel transfers")
    chunk_mb: int = Field(64, ge=5, le=5120, description="S3 multipart threshold and part size (MiB)")
    commit_every: int = Field(
        100, ge=1, le=10_000, description="Hub: files per commit (a resume point each; Hub advice: ≤ 100)"
    )
    license: str = Field("other", description="Dataset card license field (an SPDX-like id the Hub knows)")
    private: bool = Field(True, description="Hub: create the dataset repo private when it does not exist")
    hub_token_block: str | None = Field(
        None, description="Name of a Prefect Secret block holding the Hub token (default: HF_TOKEN / the login)"
    )
    aws_credentials_block: str | None = Field(
        None, description="Name of a prefect-aws AwsCredentials block (default: the usual AWS chain)"
    )


class AlertConfig(StrictModel):
    """Where failure, crash and approval-needed notifications go (also LATENTFORGE_ALERT_WEBHOOK)."""

    webhook: str | None = Field(
        None, description="Plain webhook URL (JSON POST). A URL holding a secret belongs in the environment"
    )
    block: str | None = Field(None, description="Name of a saved Prefect notification block (Slack, webhook, ...)")


_UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "unset"})()


@dataclass(frozen=True)
class Spec:
    """How a field enters the `CacheSpec` and its fingerprint: the metadata of its one declaration
    (``mode: Annotated[Mode, Spec(absent="t2v")] = Field(...)``), from which the spec, `FINGERPRINT_NAMES`,
    `ADDED_LATER` and the settings that reproduce a spec (`infra.plan.spec_settings`) are derived.

    On an `EncodingConfig` field, the spec takes the setting as given, under its name (`COPIED`: its spec field is
    made from it). On a spec field, the plan resolves the value (`infra.plan.resolve`).
    """

    #: For a field added after latentforge 0.1: the value that means "not used", the spec's default; left out of the
    #: fingerprint at it, so a cache made before the field keeps its fingerprint.
    absent: Any = _UNSET
    #: The name the fingerprint's canonical JSON gives the field (latentforge 0.1's), where it is not its own.
    fingerprint: str | None = None
    #: A field of latentforge 0.1 with a default in the spec (a spec without it reads this; it stays fingerprinted).
    default: Any = _UNSET
    #: On a spec field: restated as is under its name by the settings that reproduce a spec (a setting copied from
    #: the config always is); a value spelled otherwise in the config is restated by `infra.plan.spec_settings`.
    setting: bool = False
    #: Restated even at its absent value (the config's default is another value, or a reuse must set it).
    always: bool = False


def spec_mark(field: FieldInfo) -> Spec | None:
    """The `Spec` metadata of a field, if it has one."""
    return next((m for m in field.metadata if isinstance(m, Spec)), None)


#: The formats `infra.formats` registers, named here for the help (config sits below the formats; a test holds the
#: two equal): pt (per-sample .pt), ltx (LTX-2 trainer's .precomputed), parquet (FastVideo), webdataset, musubi
#: (musubi-tuner), diffsynth (DiffSynth-Studio).
FORMAT_NAMES = ("pt", "ltx", "parquet", "webdataset", "musubi", "diffsynth")


class EncodingConfig(StrictModel):
    """What decides the bytes of the cache: every field here (resolved with the family's defaults) is in
    the `CacheSpec`, under the same name."""

    format: Annotated[str, Spec()] = Field("pt", description="Output format: " + ", ".join(FORMAT_NAMES))
    shard_samples: int | None = Field(
        None,
        gt=0,
        le=MAX_COUNT,
        description="Shard formats (webdataset, parquet): samples per shard file before the next (default 10000)",
    )
    shard_bytes: int | None = Field(
        None,
        gt=0,
        le=MAX_BYTES,
        description="Shard formats: bytes per shard file before the next (default 1 GiB; a file ends after the "
        "sample that reaches it)",
    )
    layout: Literal["latentforge", "cc12m"] | None = Field(
        None,
        description="webdataset: cc12m writes the CC12M latent set's layout (parts 00000.tar..., members <key>.npy + "
        "<key>.txt only); default latentforge's (per source shard parts, a .json per sample)",
    )
    parquet_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="parquet: dtype of the tensor bytes (default fp32: FastVideo's reader ignores the *_dtype "
        "columns and decodes float32)",
    )
    frames: int = Field(33, gt=0, le=MAX_FRAMES, description="Frames per sample (F)")
    height: int = Field(832, gt=0, le=MAX_SIDE, description="Height of the encoded frames (H)")
    width: int = Field(832, gt=0, le=MAX_SIDE, description="Width of the encoded frames (W)")
    buckets: str | None = Field(
        None,
        description="Resolution buckets WxHxF;WxHxF (images WxHx1): per clip the nearest aspect ratio among those "
        "with F ≤ its frames, then the most frames, then the largest area (the LTX-2 trainer's rule); replaces "
        "frames/height/width",
    )
    temporal: str | None = Field(
        None,
        description="Temporal sampling: span (F frames spread over the clip: Wan2.2), head (the first F: the LTX-2 "
        "trainer's), fps:N (by time at N fps: FastVideo's), stride:K (frame --start, then every K-th) or windows:K "
        "(every stride-K window of F frames, each a sample ID@FIRST). Default: the family's",
    )
    start: int | None = Field(None, ge=0, le=MAX_COUNT, description="First source frame for stride:K and windows:K (0)")
    window_step: Annotated[int | None, Spec(absent=None)] = Field(
        None,
        gt=0,
        le=MAX_COUNT,
        description="windows:K: source frames between window starts (default: non-overlapping)",
    )
    short_clips: Literal["repeat", "skip"] | None = Field(
        None,
        description="A clip too short for the temporal policy: repeat (indices held at its last frame) or skip (with "
        "the reason and its frame count). Default: repeat for span and fps, skip for the others",
    )
    resize: (
        Literal[
            "stretch", "cover-crop", "cover-crop-aa", "musubi", "diffsynth", "torchvision", "h3-lanczos", "diffsynth-h3"
        ]
        | None
    ) = Field(
        None,
        description="Resize: stretch (bilinear to H×W: the Wan2.2 seed recipe's), cover-crop (bicubic to cover, centre "
        "crop: the LTX-2 trainer's), cover-crop-aa (bilinear with antialias, cover, centre crop), musubi "
        "(musubi-tuner's resize_image_to_bucket: cover rounded half up, LANCZOS up, OpenCV INTER_AREA down), "
        "diffsynth (DiffSynth-Studio's ImageCropAndResize: cover rounded, PIL bilinear, crop offset rounded) or "
        "torchvision (images: torchvision's Resize(BICUBIC) + CenterCrop + Normalize(0.5, 0.5) on the PIL image, "
        "number for number: the CC12M seed's) or h3-lanczos (FastVideo's MiniMax-H3 frames: Pillow LANCZOS stretch, "
        "uint8 values kept). Default: the format's consumer's (docs/formats.md), else the family's",
    )
    rotate: Literal["stored", "auto"] | None = Field(
        None,
        description="A clip whose display matrix turns it (a phone video): stored (its frames as stored, on their "
        "side, as PyAV-based readers give them) or auto (turned upright by the display matrix, as the ffmpeg program "
        "does). Default: what the format's consumer's own reader gives (DiffSynth's imageio/ffmpeg: auto; the "
        "others: stored)",
    )
    text_max_length: int | None = Field(
        None,
        gt=0,
        le=MAX_TEXT_TOKENS,
        description="Tokenizer max_length; embeddings padded to it. Default: the family's (512, LTX-2 1024)",
    )
    text_stage: Literal["pre_connector", "post_connector"] | None = Field(
        None,
        description="LTX-2: the text tensor cached: pre_connector (normalised, projected Gemma features: what the "
        "LTX-2 trainer caches) or post_connector (the connectors' outputs: FastVideo's overfit parquet)",
    )
    audio: Annotated[bool, Spec(absent=False, always=True)] = Field(
        False,
        description="Also encode each clip's audio track (families with an audio VAE; the ltx2-trainer recipe turns "
        "it on, as the trainer extracts audio unless told not to). A clip without an audio track is still encoded, "
        "its row says no_audio_track; --skip-audio is --no-audio",
        json_schema_extra={"off_flags": ["--skip-audio"]},
    )
    audio_file_length: Annotated[Literal["clip", "trainer"], Spec(absent="clip")] = Field(
        "clip",
        description="A sample's separate audio file (a metadata file's audio column): clip (trimmed or zero-padded "
        "to the clip's F / fps, as its own track) or trainer (the LTX-2 trainer's rule: trimmed to the longest "
        "bucket's F / 25 seconds, never padded; the ltx2-trainer recipe's)",
    )
    mode: Annotated[Mode, Spec(absent="t2v")] = Field(
        "t2v",
        description="LTX-2 training mode (format ltx): which .precomputed/ subfolders every sample must have "
        "(docs/ltx2.md, Training modes) and which dataset roles are read; a dataset without a role it reads is "
        "refused at plan time. i2v of a Wan image-to-video model (wan21 I2V, wan22 TI2V-5B): each sample "
        "also stores what its first frame conditions the model on",
    )
    lora_trigger: Annotated[str | None, Spec(absent=None)] = Field(
        None, description="Text prepended to every caption with one space, as the LTX-2 trainer's --lora-trigger"
    )
    remove_llm_prefixes: Annotated[bool, Spec(absent=False)] = Field(
        False,
        description="Remove the first of the LTX-2 trainer's common LLM caption openings ('The video shows', "
        "'In this video,' ...) from each caption, as its --remove-llm-prefixes",
    )
    empty_captions: Annotated[Literal["skip", "encode"], Spec(absent="skip")] = Field(
        "skip",
        description="A sample whose caption is empty: skip (a ledger row, empty_prompt) or encode (the empty text, "
        "as the LTX-2 trainer does)",
    )
    duplicate_rows: Annotated[Literal["refuse", "last"], Spec(absent="refuse")] = Field(
        "refuse",
        description="meta sources: a media file listed twice: refuse (the first row is the sample, the later ones "
        "are ledger rows, bad_layout) or last (the last row's caption is the sample's, as the LTX-2 trainer keeps "
        "it; the earlier rows are ledger rows, superseded)",
    )
    reference_downscale_factor: Annotated[int, Spec(absent=1)] = Field(
        1,
        ge=1,
        le=MAX_SIDE,
        description="LTX-2 IC-LoRA (--mode v2v-ic-lora, av2av-ic-lora): the reference video is encoded at the bucket's "
        "height and width divided by this, as the trainer's --reference-downscale-factor (> 1: one bucket only)",
    )
    reference_temporal_scale_factor: Annotated[int, Spec(absent=1)] = Field(
        1,
        ge=1,
        le=MAX_FRAMES,
        description="LTX-2 IC-LoRA: the reference keeps frame 0, then every Nth frame of the bucket's frames (stored "
        "fps divided by N), as the trainer's --reference-temporal-scale-factor (> 1: one bucket only)",
    )
    audio_durations: str | None = Field(
        None,
        description="LTX-2 audio-only modes (t2a, a2a-ic-lora, audio-inpaint): duration buckets in seconds, "
        "'2.0;4.0;8.0', as the trainer's --audio-durations: each audio file trimmed to the longest that fits, one "
        "shorter than all skipped (audio_too_short); none: the whole file",
    )
    follow_symlinks: Annotated[bool, Spec(absent=False)] = Field(
        False,
        description="Read a source's files that are links out of its root (a folder source's files and captions, a "
        "meta source's relative media paths, vbvr/wds shard files): by default such a sample is skipped "
        "(outside_source) and such a shard refused",
    )
    video_column: Annotated[str | None, Spec(absent=None)] = Field(
        None, description="meta sources: the column read as the video (default: video, else media_path, else path)"
    )
    caption_column: Annotated[str | None, Spec(absent=None)] = Field(
        None, description="meta sources: the column read as the caption (default: caption, else cap)"
    )
    text_padding: Annotated[Literal["raw", "zeros"], Spec()] = Field(
        "raw",
        description="Embedding rows past the prompt's tokens: raw (the encoder's output, as the published Wan2.2 "
        "recipe stores it) or zeros (what WanPipeline feeds the transformer)",
    )
    max_timestep_boundary: Annotated[float, Spec(absent=1.0)] = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="diffsynth: the top of the timestep range its training step draws from, a fraction of its "
        "schedule (its --max_timestep_boundary, stored in every file: split training reads it from there). "
        "Wan2.2-A14B's two experts train on two ranges: DiffSynth's example scripts give each its pair",
    )
    min_timestep_boundary: Annotated[float, Spec(absent=0.0)] = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="diffsynth: the bottom of that range (its --min_timestep_boundary); below the top",
    )
    text_storage: Annotated[Literal["padded", "trimmed"], Spec(absent="padded")] = Field(
        "padded",
        description="How text embeddings are stored: padded ([max_length, D], as the recipe) or trimmed ([seq_len, "
        "D] plus seq_len; needs --text-padding zeros; infra.formats.textpad.restore_padded gives the padded tensor "
        "back exactly)",
    )
    identity_scheme: Annotated[Literal["content", "sampled"], Spec(absent="sampled", always=True)] = Field(
        "content",
        description="How the model's identity is computed: content (every byte of every file) or sampled "
        "(latentforge 0.1's headers and samples: only to resume a cache made with it)",
    )
    video_batch: int = Field(
        1,
        ge=1,
        le=64,
        description="Clips of one shape (one bucket) encoded in one VAE call, from the samples prepared ahead. "
        "Equal to batch one within the dtype's tolerance, not bit for bit: the batch size is in the fingerprint",
    )
    vae_tiling: Annotated[bool, Spec(absent=False)] = Field(
        False,
        description="Encode each frame in overlapping tiles, blended (diffusers enable_tiling): bounded VAE memory at "
        "large H×W; changes the numbers, so it is in the fingerprint",
    )
    vae_slicing: bool = Field(
        False,
        description="With --video-batch: the VAE encodes a batch one clip at a time (diffusers enable_slicing): "
        "batch-one memory and batch-one bytes (the fingerprint's batch is then 1)",
    )
    text_quantize: Annotated[Literal["none", "int8-dynamic"], Spec(absent="none")] = Field(
        "none",
        description="Text encoder weights: none, or int8-dynamic (torch dynamic int8 quantization of its Linear "
        "layers, CPU only; changes the numbers, so it is in the fingerprint)",
    )
    load_text_encoder_in_8bit: Annotated[bool, Spec(absent=False)] = Field(
        False,
        description="ltx2: load Gemma in 8-bit (bitsandbytes LLM.int8() through transformers' BitsAndBytesConfig), "
        "the LTX-2 trainer's --load-text-encoder-in-8bit: about half its GPU memory. CUDA and bitsandbytes only; "
        "changes the numbers, so it is in the fingerprint",
    )
    dtype: Annotated[ComputeDtype, Spec(fingerprint="compute_dtype")] = Field(
        "bf16", description="Compute dtype; stored tensors are bf16 either way"
    )
    store_dtype: Annotated[StoreDtype, Spec(default="bf16")] = Field(
        "bf16",
        description="Stored dtype of latents and text embeddings: bf16, or fp16 (the image family), or fp32 "
        "(h3: FastVideo's float32 rows)",
    )

    @field_validator("temporal")
    @classmethod
    def _temporal_parses(cls, value: str | None) -> str | None:
        if value is not None:
            parse_temporal(value)
        return value

    @field_validator("buckets")
    @classmethod
    def _buckets_parse(cls, value: str | None) -> str | None:
        if value is not None:
            bucket_sizes(value)
        return value

    @field_validator("audio_durations")
    @classmethod
    def _durations_parse(cls, value: str | None) -> str | None:
        if value is not None:
            seconds_list(value, "--audio-durations")
        return value

    @model_validator(mode="after")
    def _geometry_bounded(self) -> EncodingConfig:
        """The pixels of one VAE call stay allocatable: each geometry (frames × height × width, or each bucket's)
        times video_batch under `infra.bounds.MAX_CALL_PIXELS`."""
        if self.buckets is None:
            check_geometry(self.frames, self.height, self.width, self.video_batch, "frames, height, width")
        else:
            for width, height, frames in bucket_sizes(self.buckets):
                check_geometry(frames, height, width, self.video_batch, f"--buckets {width}x{height}x{frames}")
        return self


class SelectionConfig(StrictModel):
    """Which of the source's samples this run takes."""

    limit: int | None = Field(None, gt=0, le=MAX_COUNT, description="Process at most N samples in total")
    shard_filter: str | None = Field(None, description="Only shards whose name contains this text")
    max_samples_per_shard: int | None = Field(None, gt=0, le=MAX_COUNT, description="At most N samples per shard")
    only: list[str] | None = Field(
        None,
        description="Process only these shards (SHARD) or samples (SHARD/KEY); every other ledger row is kept "
        "as it is (`latentforge rerun RUN_ID --failed-only` sets it)",
    )


class LimitsConfig(StrictModel):
    """Clips refused before reading or decoding (skipped with the reason)."""

    max_pixels: int = Field(
        4096 * 4096,
        gt=0,
        le=MAX_SIDE * MAX_SIDE,
        description="Refuse a clip whose stream declares more pixels per frame (width × height), before decoding "
        "it (skipped: too_many_pixels)",
    )
    max_frames: int = Field(
        100_000,
        gt=0,
        le=MAX_COUNT,
        description="Refuse a clip whose header declares, or whose packets count, more frames, before decoding it "
        "(skipped: too_many_frames)",
    )
    max_media_mb: int = Field(
        2048,
        gt=0,
        le=MAX_MB,
        description="Refuse a media file or tar member (a video, an image, an audio or reference file) larger than "
        "this many MiB, before any of it is read (skipped: too_large; a sparse tar member at the size it expands to)",
    )


class GatesConfig(StrictModel):
    """What the gates do when they find something, the approvals they wait for, and decode-and-verify."""

    on_conflict: OnConflict | None = Field(
        None,
        description="When OUT holds another cache or foreign files: ask (pause for a person), abort, new_dir "
        "(write OUT-vN), reuse (adopt its spec and resume). Default: ask on a Prefect server, else abort. "
        "Overwriting is never a standing setting: see approve_overwrite.",
    )
    approve_overwrite: str | None = Field(
        None,
        description="Token printed by `latentforge verify`, bound to OUT, its old→new fingerprint and what OUT held "
        "when it was printed (a file added or changed since voids it)",
    )
    on_stale: Literal["ask", "abort", "replace", "keep"] | None = Field(
        None,
        description="When done samples' sources changed since they were encoded (stale): ask (pause for a "
        "person), abort, replace (re-encode exactly those, replacing their files) or keep (record that the "
        "cache knowingly holds them). Default: ask on a Prefect server, else abort.",
    )
    approval_timeout: int = Field(
        86400, gt=0, le=MAX_SECONDS, description="Seconds an approval waits; no answer means abort"
    )
    on_loss: Literal["ask", "abort", "accept"] | None = Field(
        None,
        description="When reconciliation finds samples missing: ask (pause), abort (exit non-zero) or accept "
        "(recorded in the run report). Default: ask on a Prefect server, else abort.",
    )
    decode_samples: int = Field(
        4, ge=0, le=MAX_COUNT, description="Samples decoded back to pixels after the build (0: none)"
    )
    min_psnr: float | None = Field(
        None,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="Make decode-and-verify a gate: every decoded sample ≥ this PSNR (dB)",
    )


class RunConfig(StrictModel):
    """How the run goes: device, parallelism, batching, memory, stopping. Never changes the bytes."""

    text_offload: bool = Field(
        False,
        description="Encode a shard's (or chunk's) prompts first, then move the text encoder off the device (on CPU: "
        "free it) before the VAE runs; a prompt met later brings it back. Same bytes",
    )
    device: Device = Field("auto", description="auto → cuda, else neuron (torch-neuronx), else cpu")
    devices: str | None = Field(
        None,
        pattern=r"^\s*\d+(\s*,\s*\d+)*\s*$",
        description="With --device cuda: the GPUs to place shard tasks on, by index (0,2); none: every visible GPU. "
        "A task per GPU runs at once (at least; --workers more share them), each with its own decoders",
    )
    dry_run: bool = Field(False, description="Encode one sample, print its shapes, write nothing")
    workers: int = Field(
        2, ge=1, le=64, description="Shards processed at once (bounded task runner; at least one per GPU placed on)"
    )
    runner: Literal["local", "ray"] = Field(
        "local",
        description="Where the shard tasks run: local (threads of this process) or ray (Prefect's RayTaskRunner: a "
        "task per shard or chunk on a Ray cluster; needs pip install 'latentforge[ray]'). Same bytes either way",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to run on (ray://HOST:10001, or auto); none: a local cluster of --workers CPUs, "
        "started for the run and stopped at its end",
    )
    chunk_size: int | None = Field(
        None,
        gt=0,
        le=MAX_COUNT,
        description="Split a shard of more samples into chunks of this many, each its own task and ledger part "
        "(merged into the shard's ledger when its chunks end); none: one task per shard",
    )
    prefetch: int = Field(
        2,
        ge=0,
        le=64,
        description="Samples decoded, sampled and resized ahead of the encoder, per shard (0: one at a time)",
    )
    decode_workers: int = Field(
        1,
        ge=1,
        le=32,
        description="Decoders of the prefetched samples, per shard task (threads, each computing with its share of "
        "torch's intra-op threads, or processes, one intra-op thread each)",
    )
    decode_pool: Literal["thread", "process"] = Field(
        "thread",
        description="What the decode workers are: threads of the shard task (they share the GIL: ~1.6x on 2) or "
        "processes started once per shard task (spawned; pixels back in shared memory). Same bytes either way",
    )
    text_batch: int = Field(
        8,
        ge=1,
        le=256,
        description="Prompts encoded in one text-encoder call (a prompt not yet encoded, with upcoming ones)",
    )
    text_cache_mb: int = Field(
        512,
        ge=0,
        le=MAX_MB,
        description="MiB of prompt embeddings kept per shard task (per chunk with --chunk-size): an identical prompt "
        "within it is encoded once",
    )
    grace_seconds: int = Field(
        30,
        gt=0,
        le=86_400,
        description="On SIGTERM or Ctrl-C: seconds to finish the samples in flight and seal the ledgers before "
        "the run ends at once (exit 75 either way; a second signal ends it at once)",
    )


#: The sections of BuildConfig whose keys a config file and the flags give flat.
SECTIONS: dict[str, type[StrictModel]] = {
    "encoding": EncodingConfig,
    "selection": SelectionConfig,
    "limits": LimitsConfig,
    "gates": GatesConfig,
    "run": RunConfig,
}
#: A flat key → its section.
SECTION_OF: dict[str, str] = {name: section for section, model in SECTIONS.items() for name in model.model_fields}


#: The error type of a source or model URL that holds credentials: shown without its value (`flows.cli_options`).
URL_CREDENTIALS = "url_credentials"


def checked_url(value: str) -> str:
    """`value` (a setting that may be a URL: ``--source``, ``--model``, ``--out``, an upload target), unless it holds
    credentials (refused as `URL_CREDENTIALS`, its value never shown) or names a bucket S3 refuses (`infra.urls`)."""
    problem = url_problem(value)
    if problem is not None and secret_in(value) is not None:
        raise PydanticCustomError(URL_CREDENTIALS, problem)
    if problem is not None:
        raise ValueError(problem)
    return value


class BuildConfig(StrictModel):
    """Everything `latentforge build` takes: a few top-level settings and the sections. Every setting is a
    config-file key and a ``--flag``, flat (``frames``, ``--frames``); `STEP_SETTINGS` says which the single
    steps (sanity, verify, reconcile, decode) take."""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, values: Any) -> Any:
        """``frames: 33`` → ``encoding: {frames: 33}``; a section given nested is kept, a flat key of the same
        setting wins over it. Unknown keys stay where they are, for ``extra="forbid"`` to name."""
        if not isinstance(values, dict):
            return values
        sorted_values: dict[str, Any] = {}
        for key, value in values.items():
            if key in SECTIONS and isinstance(value, BaseModel):
                value = value.model_dump(exclude_unset=True)  # what was given, so a recipe still fills the rest
            if key in SECTIONS and isinstance(value, dict):
                sorted_values[key] = {**value, **sorted_values.get(key, {})}
            elif key in SECTION_OF:
                sorted_values.setdefault(SECTION_OF[key], {})[key] = value
            else:
                sorted_values[key] = value
        return sorted_values

    source: str = Field(
        description="KIND:PATH, e.g. vbvr:/data/shards (a directory, one .tar, or a glob); PATH may be a URL "
        "(s3://, hf://datasets/ORG/NAME[@rev]/..., gs://: docs/object-storage.md)"
    )
    model: str = Field(
        description="Local diffusers pipeline directory (model_index.json, vae/, ...), or hf://ORG/NAME[@rev] or "
        "s3://BUCKET/PREFIX: the parts the cache needs, fetched once per machine"
    )
    out: str = Field(description="Cache root directory")
    family: str | None = Field(None, description="Model family; detected from model_index.json when omitted")
    recipe: str | None = Field(
        None,
        description="A named recipe (`latentforge recipes`): the settings it fixes, under the config file's and "
        "the flags'",
    )
    encoding: EncodingConfig = Field(default_factory=EncodingConfig, description="What decides the bytes")
    selection: SelectionConfig = Field(default_factory=SelectionConfig, description="What is selected")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Clips refused before decoding")
    gates: GatesConfig = Field(default_factory=GatesConfig, description="Gates and approvals")
    run: RunConfig = Field(default_factory=RunConfig, description="How the run goes (never the bytes)")
    upload: UploadConfig | None = Field(None, description="Publish the cache after the gates pass")
    alerts: AlertConfig | None = Field(None, description="Notifications on failure, crash and approval-needed")

    @field_validator("source")
    @classmethod
    def _source_has_kind(cls, value: str) -> str:
        if ":" not in value or value.index(":") == 0:
            raise ValueError(f"source must be KIND:PATH (e.g. vbvr:/data/shards), got {value!r}")
        return value

    @field_validator("source", "model", "out")
    @classmethod
    def _no_credentials_in_a_url(cls, value: str) -> str:
        """A URL with credentials of any shape (``user:password@``, a signed query: `infra.urls.secret_in`) is refused
        and not shown: the settings are recorded in OUT and in Prefect; a store's credentials come from its own chain
        (docs/object-storage.md). An S3 bucket name S3 refuses is one line here, not a store library's error later."""
        return checked_url(value)

    @model_validator(mode="after")
    def _quantize_on_cpu(self) -> BuildConfig:
        """int8-dynamic on an accelerator named up front is refused here, before any import or server start (with
        ``--device auto`` the model load refuses it, once the device is known: `infra.models.memory.quantized`)."""
        if self.encoding.text_quantize == "int8-dynamic" and self.run.device not in ("auto", "cpu"):
            raise QuantizeOffCpu(self.run.device)
        return self

    @classmethod
    def settings(cls) -> dict[str, FieldInfo]:
        """Every setting by its flat name (the flag's and the config file's), top-level ones and the sections'
        fields, in the model's order."""
        found: dict[str, FieldInfo] = {}
        for name, field in cls.model_fields.items():
            found.update(SECTIONS[name].model_fields if name in SECTIONS else {name: field})
        return found

    def given(self) -> dict[str, Any]:
        """The settings given (not defaults), flat: what a recipe fills under and `with_values` keeps."""
        values = self.model_dump(exclude_unset=True)
        flat = {k: v for k, v in values.items() if k not in SECTIONS}
        for section in SECTIONS:
            flat.update(values.get(section, {}))
        return flat

    def with_values(self, **flat: Any) -> BuildConfig:
        """A validated copy with the flat settings `flat` changed (``config.with_values(only=[...])``)."""
        return BuildConfig.model_validate({**self.given(), **flat})


#: The settings each single step takes as options (`build` takes every one): a top-level field, a whole section or
#: ``section.field``, in the order of its ``--help``. OUT is the positional argument of verify, reconcile and decode.
STEP_SETTINGS: dict[str, tuple[str, ...]] = {
    "sanity": (
        "source", "model", "out", "family", "recipe", "encoding", "run.device",
        "selection.limit", "selection.shard_filter", "selection.max_samples_per_shard", "limits", "alerts",
    ),
    "verify": ("model", "family", "recipe", "encoding"),
    "reconcile": (
        "source", "model", "family", "recipe", "encoding",
        "selection.limit", "selection.shard_filter", "selection.max_samples_per_shard",
    ),
    "decode": ("source", "model", "run.device", "encoding.dtype", "gates.decode_samples", "gates.min_psnr"),
}  # fmt: skip


def step_settings(step: str) -> dict[str, FieldInfo]:
    """The settings (flat name → field) that `step` takes as options (``build``: all of them)."""
    if step == "build":
        return BuildConfig.settings()
    found: dict[str, FieldInfo] = {}
    for entry in STEP_SETTINGS[step]:
        section, _, name = entry.partition(".")
        if name:
            found[name] = SECTIONS[section].model_fields[name]
        elif entry in SECTIONS:
            found.update(SECTIONS[entry].model_fields)
        else:
            found[entry] = BuildConfig.model_fields[entry]
    return found


class _PlannedSpec(StrictModel):
    """The CacheSpec's values the plan resolves or computes (`infra.plan.resolve`); `CacheSpec` adds the settings
    the spec takes as given, made from their `EncodingConfig` fields."""

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        """A cache.json written before the spec took the config's names (``compute_dtype`` ...) still loads."""
        if not isinstance(values, dict):
            return values
        renamed = {old: new for new, old in FINGERPRINT_NAMES.items() if old in values}
        if both := [new for new in renamed.values() if new in values]:
            raise ValueError(f"spec names {', '.join(both)} twice (old and new name)")
        return {renamed.get(k, k): v for k, v in values.items()}

    spec_version: int = SPEC_VERSION
    family: Annotated[str, Spec(setting=True)]
    model_identity: dict[str, str] = Field(description="Per component: the hash of its files, by identity_scheme")
    frames: Annotated[int, Spec(setting=True)]
    height: Annotated[int, Spec(setting=True)]
    width: Annotated[int, Spec(setting=True)]
    temporal: str
    start: Annotated[int, Spec(absent=0, fingerprint="temporal_start", setting=True)] = 0
    short_clips: Annotated[str | None, Spec(absent=None, setting=True)] = Field(
        None, description="None: the temporal policy's default"
    )
    resize: str = "bilinear-align_corners_false"
    rotate: Annotated[str, Spec(absent="stored", setting=True, always=True)] = Field(
        "stored", description="A rotated clip's frames: stored, or auto (turned by its display matrix)"
    )
    buckets: Annotated[list[tuple[int, int, int]] | None, Spec(absent=None)] = Field(
        None, description="(W, H, F) per bucket"
    )
    text_max_length: Annotated[int, Spec(setting=True)]
    shard_samples: Annotated[int | None, Spec(absent=None, setting=True)] = Field(
        None, description="Shard formats: samples per shard file"
    )
    shard_bytes: Annotated[int | None, Spec(absent=None, setting=True)] = Field(
        None, description="Shard formats: bytes per shard file"
    )
    parquet_dtype: Annotated[str | None, Spec(absent=None, setting=True)] = Field(
        None, description="parquet: dtype of the tensor bytes"
    )
    video_batch: Annotated[int, Spec(absent=1, setting=True)] = Field(
        1, description="Clips per VAE call (short batches padded to it)"
    )
    model_version: Annotated[str | None, Spec(absent=None)] = Field(
        None,
        description="The model's version, where the family records one (ltx2: 2.5, a Gemma 4 text encoder). LTX-2.0 "
        "and 2.3 record none, so caches made before the field keep their fingerprints (their model identity differs)",
    )
    latent_norm: str = Field(description="How latents are normalised before storing")
    text_stage: Annotated[str, Spec(fingerprint="text_encoder_output")] = "last_hidden_state"
    layout: Annotated[str | None, Spec(absent=None)] = Field(
        None, description="The consumer's layout the bytes follow (infra.formats.consumers): fastvideo, cc12m"
    )
    preprocess: Annotated[str | None, Spec(absent=None)] = Field(
        None, description="The family's own image preprocessing (module:qualname), in place of the resize policy"
    )
    audio_durations: Annotated[list[float] | None, Spec(absent=None)] = Field(
        None, description="Audio-only modes: duration buckets (seconds)"
    )
    text_clean: Annotated[str | None, Spec(absent=None)] = Field(
        None, description="The cleaning the format's consumer applies to a prompt before its tokenizer (whitespace)"
    )
    conditioning: Annotated[str | None, Spec(absent=None)] = Field(
        None,
        description="--mode i2v of an image-to-video model: what each sample stores of its first frame (the family's "
        "`conditioning`: Wan's y and CLIP features, TI2V-5B's first latent frame)",
    )

    def canonical(self) -> dict[str, Any]:
        """What the fingerprint hashes: the spec's JSON under latentforge 0.1's names (`FINGERPRINT_NAMES`), without
        the fields added since at their absent values (`ADDED_LATER`)."""
        data = self.model_dump(mode="json")
        for name, absent in ADDED_LATER.items():  # a field added since 0.1, at its absent value: left out
            if data[name] == absent:
                del data[name]
        return {FINGERPRINT_NAMES.get(k, k): v for k, v in data.items()}

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of the spec (sorted keys, no whitespace): see `canonical`."""
        return fingerprint_of(self.canonical())

    def differences(self, other: _PlannedSpec) -> dict[str, tuple[Any, Any]]:
        """Field by field: {field: (mine, theirs)} where they differ."""
        mine, theirs = self.model_dump(mode="json"), other.model_dump(mode="json")
        keys = sorted(set(mine) | set(theirs))
        return {k: (mine.get(k), theirs.get(k)) for k in keys if mine.get(k) != theirs.get(k)}


def _spec_field(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """The CacheSpec field made from a setting's `EncodingConfig` field: its type, constraints and description, with
    the spec's default (`Spec.absent`, else `Spec.default`, else none: required)."""
    mark = spec_mark(field)
    assert mark is not None
    made = copy.copy(field)
    made.default = next((d for d in (mark.absent, mark.default) if d is not _UNSET), PydanticUndefined)
    return field.annotation, made


#: The settings the spec takes as given: the `EncodingConfig` fields marked `Spec`, under their names.
COPIED: tuple[str, ...] = tuple(name for name, field in EncodingConfig.model_fields.items() if spec_mark(field))

#: What decides the bytes of the cache, under the config's names. Its fingerprint gates resume. The values the plan
#: resolves are `_PlannedSpec`'s fields; each setting the spec takes as given is its `EncodingConfig` field (`COPIED`).
CacheSpec = create_model(
    "CacheSpec",
    __base__=_PlannedSpec,
    __module__=__name__,
    __doc__="What decides the bytes of the cache, under the config's names. Its fingerprint gates resume.",
    **{name: _spec_field(EncodingConfig.model_fields[name]) for name in COPIED},
)

#: CacheSpec fields that `fingerprint()` (and no other place) names as latentforge 0.1 did, so existing caches keep
#: their fingerprints: the spec now has the config's names, the canonical JSON the old ones (`Spec.fingerprint`).
FINGERPRINT_NAMES: dict[str, str] = {
    name: mark.fingerprint
    for name, field in CacheSpec.model_fields.items()
    if (mark := spec_mark(field)) and mark.fingerprint
}

#: Spec fields added after latentforge 0.1, with the value that means "not used" (`Spec.absent`): left out of the
#: fingerprint at that value, so a cache made without them keeps its fingerprint.
ADDED_LATER: dict[str, Any] = {
    name: mark.absent
    for name, field in CacheSpec.model_fields.items()
    if (mark := spec_mark(field)) and mark.absent is not _UNSET
}


def fingerprint_of(data: dict[str, Any]) -> str:
    """sha256 hex of canonical JSON."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


#: A config file over this size is not one (a config is a few hundred bytes; read whole, so bounded).
MAX_CONFIG_BYTES = 1 << 20


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML (or JSON) config file into a plain dict (keys use underscores, like the flags); ConfigError, one
    line naming the file, for one that cannot be read, is not UTF-8, is not YAML, nests too deep or is not a
    mapping."""
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config {path}: over {MAX_CONFIG_BYTES} bytes, not a config file")
    try:
        loaded = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): a config file "
            "is UTF-8 YAML or JSON"
        ) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"--config {path}: not YAML or JSON{at}: {problem}") from exc
    except RecursionError as exc:
        raise ConfigError(f"--config {path}: nested too deeply to be a config file") from exc
    if not isinstance(loaded, dict | None):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
    return {str(k).replace("-", "_"): v for k, v in (loaded or {}).items()}


def merge_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> BuildConfig:
    """Flags win over the file; flags left unset (None) do not override."""
    merged = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    return BuildConfig.model_validate(merged)
