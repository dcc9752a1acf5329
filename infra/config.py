"""Typed configuration: the run options (BuildConfig) and the cache's identity (CacheSpec).

BuildConfig is what a user gives (YAML file, CLI flags, Prefect form). CacheSpec is the part that
decides the bytes of the cache; its fingerprint is written to ``cache.json`` and into every sample,
and a resume is allowed only when fingerprints match. Run options that do not change bytes
(device, limits, workers) stay out of the spec.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.errors import ConfigError, QuantizeOffCpu

#: Bump when the meaning of a spec field or the stored layout changes: old caches stop matching.
SPEC_VERSION = 1

Device = Literal["auto", "cpu", "cuda", "neuron"]
ComputeDtype = Literal["bf16", "fp32"]
StoreDtype = Literal["bf16", "fp16"]
OnConflict = Literal["ask", "abort", "new_dir", "reuse"]


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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
    on_conflict: Literal["ask", "abort"] | None = Field(
        None,
        description="When a remote file differs from ours: ask (pause for a person) or abort. "
        "Default: ask on a Prefect server, else abort. Replacing is never a standing setting: see approve_replace.",
    )
    workers: int = Field(8, ge=1, le=64, description="Parallel transfers")
    chunk_mb: int = Field(64, ge=5, le=5120, description="S3 multipart threshold and part size (MiB)")
    commit_every: int = Field(100, ge=1, description="Hub: files per commit (a resume point each; Hub advice: ≤ 100)")
    license: str = Field("other", description="Dataset card license field (an SPDX-like id the Hub knows)")
    private: bool = Field(True, description="Hub: create the dataset repo private when it does not exist")
    hub_token_block: str | None = Field(
        None, description="Name of a Prefect Secret block holding the Hub token (default: HF_TOKEN / the login)"
    )
    aws_credentials_block: str | None = Field(
        None, description="Name of a prefect-aws AwsCredentials block (default: the usual AWS chain)"
    )

    @field_validator("to")
    @classmethod
    def _target_parses(cls, value: str) -> str:
        from infra.publish.base import parse_target  # noqa: PLC0415 - config stays importable on its own

        parse_target(value)
        return value


class AlertConfig(StrictModel):
    """Where failure, crash and approval-needed notifications go (also LATENTFORGE_ALERT_WEBHOOK)."""

    webhook: str | None = Field(
        None, description="Plain webhook URL (JSON POST). A URL holding a secret belongs in the environment"
    )
    block: str | None = Field(None, description="Name of a saved Prefect notification block (Slack, webhook, ...)")


def _in(group: str, **extra: Any) -> dict[str, Any]:
    """A field's group (which steps take it as an option: see `STEP_GROUPS`) for ``json_schema_extra``."""
    return {"json_schema_extra": {"group": group, **extra}}


class BuildConfig(StrictModel):
    """Everything `latentforge build` takes; each field is a config-file key and a ``--flag``.

    Every field names its group; `STEP_GROUPS` says which steps (sanity, verify, reconcile, decode) take it."""

    @model_validator(mode="before")
    @classmethod
    def _recipe_under_values(cls, values: Any) -> Any:
        """A named recipe's settings, under every value given (file and flags win)."""
        from infra.recipes import with_recipe  # noqa: PLC0415 - config stays importable on its own

        return with_recipe(values) if isinstance(values, dict) else values

    @field_validator("temporal")
    @classmethod
    def _temporal_parses(cls, value: str | None) -> str | None:
        from infra.media.temporal import parse_temporal  # noqa: PLC0415 - config stays importable on its own

        if value is not None:
            parse_temporal(value)
        return value

    source: str = Field(
        description="KIND:PATH, e.g. vbvr:/data/shards (a directory, one .tar, or a glob)", **_in("source")
    )
    model: str = Field(description="Local diffusers pipeline directory (model_index.json, vae/, ...)", **_in("model"))
    out: str = Field(description="Cache root directory", **_in("out"))
    family: str | None = Field(
        None, description="Model family; detected from model_index.json when omitted", **_in("family")
    )
    recipe: str | None = Field(
        None,
        description="A named recipe (`latentforge recipes`): the settings it fixes, under the config file's and "
        "the flags'",
        **_in("spec"),
    )
    format: str = Field("pt", description="Output format", **_in("spec"))
    shard_samples: int | None = Field(
        None,
        gt=0,
        description="Shard formats (webdataset, parquet): samples per shard file before the next (default 10000)",
        **_in("spec"),
    )
    shard_bytes: int | None = Field(
        None,
        gt=0,
        description="Shard formats: bytes per shard file before the next (default 1 GiB; a file ends after the "
        "sample that reaches it)",
        **_in("spec"),
    )
    layout: Literal["latentforge", "cc12m"] | None = Field(
        None,
        description="webdataset: cc12m writes the CC12M latent set's layout (parts 00000.tar..., members <key>.npy + "
        "<key>.txt only); default latentforge's (per source shard parts, a .json per sample)",
        **_in("spec"),
    )
    parquet_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="parquet: dtype of the tensor bytes (default fp32: FastVideo's reader ignores the *_dtype "
        "columns and decodes float32)",
        **_in("spec"),
    )
    frames: int = Field(33, gt=0, description="Frames per sample (F)", **_in("spec"))
    height: int = Field(832, gt=0, description="Height of the encoded frames (H)", **_in("spec"))
    width: int = Field(832, gt=0, description="Width of the encoded frames (W)", **_in("spec"))
    buckets: str | None = Field(
        None,
        description="Resolution buckets WxHxF;WxHxF (images WxHx1): per clip the nearest aspect ratio among those "
        "with F ≤ its frames, then the most frames, then the largest area (the LTX-2 trainer's rule); replaces "
        "frames/height/width",
        **_in("spec"),
    )
    temporal: str | None = Field(
        None,
        description="Temporal sampling: span (F frames spread over the clip: Wan2.2), head (the first F: the LTX-2 "
        "trainer's), fps:N (by time at N fps: FastVideo's), stride:K (frame --start, then every K-th) or windows:K "
        "(every stride-K window of F frames, each a sample ID@FIRST). Default: the family's",
        **_in("spec"),
    )
    start: int | None = Field(
        None, ge=0, description="First source frame for stride:K and windows:K (0)", **_in("spec")
    )
    window_step: int | None = Field(
        None,
        gt=0,
        description="windows:K: source frames between window starts (default: non-overlapping)",
        **_in("spec"),
    )
    short_clips: Literal["repeat", "skip"] | None = Field(
        None,
        description="A clip too short for the temporal policy: repeat (indices held at its last frame) or skip (with "
        "the reason and its frame count). Default: repeat for span and fps, skip for the others",
        **_in("spec"),
    )
    resize: Literal["stretch", "cover-crop", "cover-crop-aa"] | None = Field(
        None,
        description="Resize: stretch (bilinear to H×W: Wan2.2), cover-crop (bicubic to cover, centre crop: the "
        "LTX-2 trainer's) or cover-crop-aa (bilinear with antialias, cover, centre crop: FastVideo's). Default: the "
        "family's",
        **_in("spec"),
    )
    text_max_length: int | None = Field(
        None,
        gt=0,
        description="Tokenizer max_length; embeddings padded to it. Default: the family's (512, LTX-2 1024)",
        **_in("spec"),
    )
    text_stage: Literal["pre_connector", "post_connector"] | None = Field(
        None,
        description="LTX-2: the text tensor cached: pre_connector (normalised, projected Gemma features: what the "
        "LTX-2 trainer caches) or post_connector (the connectors' outputs: FastVideo's overfit parquet)",
        **_in("spec"),
    )
    audio: bool = Field(
        False, description="Also encode each clip's audio track (families with an audio VAE)", **_in("spec")
    )
    text_padding: Literal["raw", "zeros"] = Field(
        "raw",
        description="Embedding rows past the prompt's tokens: raw (the encoder's output, as the published Wan2.2 "
        "recipe stores it) or zeros (what WanPipeline feeds the transformer)",
        **_in("spec"),
    )
    text_storage: Literal["padded", "trimmed"] = Field(
        "padded",
        description="How text embeddings are stored: padded ([max_length, D], as the recipe) or trimmed ([seq_len, "
        "D] plus seq_len; needs --text-padding zeros; infra.formats.textpad.restore_padded gives the padded tensor "
        "back exactly)",
        **_in("spec"),
    )
    identity_scheme: Literal["content", "sampled"] = Field(
        "content",
        description="How the model's identity is computed: content (every byte of every file) or sampled "
        "(latentforge 0.1's headers and samples: only to resume a cache made with it)",
        **_in("spec"),
    )
    video_batch: int = Field(
        1,
        ge=1,
        le=64,
        description="Clips of one shape (one bucket) encoded in one VAE call, from the samples prepared ahead. "
        "Equal to batch one within the dtype's tolerance, not bit for bit: the batch size is in the fingerprint",
        **_in("spec"),
    )
    vae_tiling: bool = Field(
        False,
        description="Encode each frame in overlapping tiles, blended (diffusers enable_tiling): bounded VAE memory at "
        "large H×W; changes the numbers, so it is in the fingerprint",
        **_in("spec"),
    )
    vae_slicing: bool = Field(
        False,
        description="With --video-batch: the VAE encodes a batch one clip at a time (diffusers enable_slicing): "
        "batch-one memory and batch-one bytes (the fingerprint's batch is then 1)",
        **_in("spec"),
    )
    text_quantize: Literal["none", "int8-dynamic"] = Field(
        "none",
        description="Text encoder weights: none, or int8-dynamic (torch dynamic int8 quantization of its Linear "
        "layers, CPU only; changes the numbers, so it is in the fingerprint)",
        **_in("spec"),
    )
    text_offload: bool = Field(
        False,
        description="Encode a shard's (or chunk's) prompts first, then move the text encoder off the device (on CPU: "
        "free it) before the VAE runs; a prompt met later brings it back. Same bytes",
        **_in("run"),
    )
    device: Device = Field("auto", description="auto → cuda, else neuron (torch-neuronx), else cpu", **_in("device"))
    dtype: ComputeDtype = Field("bf16", description="Compute dtype; stored tensors are bf16 either way", **_in("dtype"))
    store_dtype: StoreDtype = Field(
        "bf16",
        description="Stored dtype of latents and text embeddings: bf16, or fp16 (the image family)",
        **_in("spec"),
    )
    limit: int | None = Field(None, gt=0, description="Process at most N samples in total", **_in("selection"))
    shard_filter: str | None = Field(None, description="Only shards whose name contains this text", **_in("selection"))
    max_samples_per_shard: int | None = Field(None, gt=0, description="At most N samples per shard", **_in("selection"))
    max_pixels: int = Field(
        4096 * 4096,
        gt=0,
        description="Refuse a clip whose stream declares more pixels per frame (width × height), before decoding "
        "it (skipped: too_many_pixels)",
        **_in("limits"),
    )
    max_frames: int = Field(
        100_000,
        gt=0,
        description="Refuse a clip whose header declares, or whose packets count, more frames, before decoding it "
        "(skipped: too_many_frames)",
        **_in("limits"),
    )
    dry_run: bool = Field(False, description="Encode one sample, print its shapes, write nothing", **_in("build"))
    on_conflict: OnConflict | None = Field(
        None,
        description="When OUT holds another cache or foreign files: ask (pause for a person), abort, new_dir "
        "(write OUT-vN), reuse (adopt its spec and resume). Default: ask on a Prefect server, else abort. "
        "Overwriting is never a standing setting: see approve_overwrite.",
        **_in("conflict"),
    )
    approve_overwrite: str | None = Field(
        None,
        description="Token printed by `latentforge verify`, bound to OUT and its old→new fingerprint",
        **_in("conflict"),
    )
    on_stale: Literal["ask", "abort", "replace", "keep"] | None = Field(
        None,
        description="When done samples' sources changed since they were encoded (stale): ask (pause for a "
        "person), abort, replace (re-encode exactly those, replacing their files) or keep (record that the "
        "cache knowingly holds them). Default: ask on a Prefect server, else abort.",
        **_in("stale"),
    )
    approval_timeout: int = Field(
        86400, gt=0, description="Seconds an approval waits; no answer means abort", **_in("approvals")
    )
    on_loss: Literal["ask", "abort", "accept"] | None = Field(
        None,
        description="When reconciliation finds samples missing: ask (pause), abort (exit non-zero) or accept "
        "(recorded in the run report). Default: ask on a Prefect server, else abort.",
        **_in("loss"),
    )
    decode_samples: int = Field(
        4, ge=0, description="Samples decoded back to pixels after the build (0: none)", **_in("decode")
    )
    min_psnr: float | None = Field(
        None, description="Make decode-and-verify a gate: every decoded sample ≥ this PSNR (dB)", **_in("decode")
    )
    workers: int = Field(2, ge=1, le=64, description="Shards processed at once (bounded task runner)", **_in("run"))
    runner: Literal["local", "ray"] = Field(
        "local",
        description="Where the shard tasks run: local (threads of this process) or ray (Prefect's RayTaskRunner: a "
        "task per shard or chunk on a Ray cluster; needs pip install 'latentforge[ray]'). Same bytes either way",
        **_in("run"),
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to run on (ray://HOST:10001, or auto); none: a local cluster of --workers CPUs, "
        "started for the run and stopped at its end",
        **_in("run"),
    )
    chunk_size: int | None = Field(
        None,
        gt=0,
        description="Split a shard of more samples into chunks of this many, each its own task and ledger part "
        "(merged into the shard's ledger when its chunks end); none: one task per shard",
        **_in("run"),
    )
    prefetch: int = Field(
        2,
        ge=0,
        le=64,
        description="Samples decoded, sampled and resized ahead of the encoder, per shard (0: one at a time)",
        **_in("run"),
    )
    decode_workers: int = Field(
        1, ge=1, le=32, description="Threads decoding the prefetched samples, per shard", **_in("run")
    )
    text_batch: int = Field(
        8,
        ge=1,
        le=256,
        description="Prompts encoded in one text-encoder call (a prompt not yet encoded, with upcoming ones)",
        **_in("run"),
    )
    text_cache_mb: int = Field(
        512,
        ge=0,
        description="MiB of prompt embeddings kept per process: an identical prompt is encoded once",
        **_in("run"),
    )
    grace_seconds: int = Field(
        30,
        gt=0,
        description="On SIGTERM or Ctrl-C: seconds to finish the samples in flight and seal the ledgers before "
        "the run ends at once (exit 75 either way; a second signal ends it at once)",
        **_in("run"),
    )
    only: list[str] | None = Field(
        None,
        description="Process only these shards (SHARD) or samples (SHARD/KEY); every other ledger row is kept "
        "as it is (`latentforge rerun RUN_ID --failed-only` sets it)",
        **_in("rerun"),
    )
    upload: UploadConfig | None = Field(None, description="Publish the cache after the gates pass", **_in("publish"))
    alerts: AlertConfig | None = Field(
        None, description="Notifications on failure, crash and approval-needed", **_in("alerts")
    )

    @field_validator("runner")
    @classmethod
    def _runner_installed(cls, value: str) -> str:
        if value == "ray":
            from infra.ops.runners import require_ray  # noqa: PLC0415 - config stays importable on its own

            require_ray()
        return value

    @field_validator("source")
    @classmethod
    def _source_has_kind(cls, value: str) -> str:
        if ":" not in value or value.index(":") == 0:
            raise ValueError(f"source must be KIND:PATH (e.g. vbvr:/data/shards), got {value!r}")
        return value

    @model_validator(mode="after")
    def _quantize_on_cpu(self) -> BuildConfig:
        """int8-dynamic on an accelerator named up front is refused here, before any import or server start (with
        ``--device auto`` the model load refuses it, once the device is known: `infra.models.memory.quantized`)."""
        if self.text_quantize == "int8-dynamic" and self.device not in ("auto", "cpu"):
            raise QuantizeOffCpu(self.device)
        return self


#: The groups of BuildConfig fields each single step takes as options (`build` takes every field). OUT is
#: the positional argument of verify, reconcile and decode.
STEP_GROUPS: dict[str, tuple[str, ...]] = {
    "sanity": ("source", "model", "family", "out", "spec", "dtype", "device", "selection", "limits", "alerts"),
    "verify": ("model", "family", "spec", "dtype"),
    "reconcile": ("source", "model", "family", "spec", "dtype", "selection"),
    "decode": ("source", "model", "device", "dtype", "decode"),
}


def field_group(name: str) -> str:
    """The group a BuildConfig field belongs to."""
    extra = BuildConfig.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or "group" not in extra:
        raise TypeError(f"BuildConfig.{name} names no group")
    return str(extra["group"])


def step_fields(step: str) -> list[str]:
    """The BuildConfig fields that `step` takes as options, in the model's order (``build``: all of them)."""
    if step == "build":
        return list(BuildConfig.model_fields)
    groups = STEP_GROUPS[step]
    return [name for name in BuildConfig.model_fields if field_group(name) in groups]


#: Spec fields added after latentforge 0.1, with the value that means "not used": left out of the fingerprint at
#: that value, so a cache made without them keeps its fingerprint.
ADDED_LATER: dict[str, Any] = {
    "identity_scheme": "sampled",
    "buckets": None,
    "audio": False,
    "shard_samples": None,
    "shard_bytes": None,
    "parquet_dtype": None,
    "temporal_start": 0,
    "window_step": None,
    "short_clips": None,
    "text_storage": "padded",
    "video_batch": 1,
    "vae_tiling": False,
    "text_quantize": "none",
    "layout": None,
}


class CacheSpec(StrictModel):
    """What decides the bytes of the cache. Its fingerprint gates resume."""

    spec_version: int = SPEC_VERSION
    family: str
    model_identity: dict[str, str] = Field(description="Per component: the hash of its files, by identity_scheme")
    #: A cache.json without the field was made by latentforge 0.1, with the sampled identity.
    identity_scheme: Literal["content", "sampled"] = "sampled"
    format: str
    frames: int
    height: int
    width: int
    temporal: str
    temporal_start: int = 0
    window_step: int | None = None
    short_clips: str | None = Field(None, description="None: the temporal policy's default")
    resize: str = "bilinear-align_corners_false"
    buckets: list[tuple[int, int, int]] | None = Field(None, description="(W, H, F) per bucket")
    audio: bool = False
    compute_dtype: ComputeDtype
    store_dtype: StoreDtype = "bf16"
    text_max_length: int
    text_padding: str
    shard_samples: int | None = Field(None, description="Shard formats: samples per shard file")
    shard_bytes: int | None = Field(None, description="Shard formats: bytes per shard file")
    parquet_dtype: str | None = Field(None, description="parquet: dtype of the tensor bytes")
    text_storage: Literal["padded", "trimmed"] = "padded"
    video_batch: int = Field(1, description="Clips per VAE call (short batches padded to it)")
    vae_tiling: bool = Field(False, description="VAE tiled encoding (diffusers enable_tiling, its default tiles)")
    text_quantize: Literal["none", "int8-dynamic"] = "none"
    latent_norm: str = Field(description="How latents are normalised before storing")
    text_encoder_output: str = "last_hidden_state"
    layout: str | None = Field(
        None, description="The consumer's layout the bytes follow (infra.formats.consumers): fastvideo, cc12m"
    )

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of the spec (sorted keys, no whitespace). A spec of the sampled identity
        scheme leaves that field out, as latentforge 0.1 did, so its caches keep their fingerprints."""
        data = self.model_dump(mode="json")
        for name, absent in ADDED_LATER.items():  # a field added since 0.1, at its absent value: left out
            if data[name] == absent:
                del data[name]
        return fingerprint_of(data)

    def build_settings(self) -> dict[str, Any]:
        """The BuildConfig keys that reproduce this spec (reuse, verify against OUT's own cache.json)."""
        from infra.media.video import resize_policy_of  # noqa: PLC0415 - config stays importable on its own

        settings: dict[str, Any] = {
            "family": self.family,
            "format": self.format,
            "frames": self.frames,
            "height": self.height,
            "width": self.width,
            "temporal": self.temporal_policy().name,
            "resize": resize_policy_of(self.resize),
            "dtype": self.compute_dtype,
            "text_max_length": self.text_max_length,
            "text_padding": self.text_padding,
            "identity_scheme": self.identity_scheme,
            "audio": self.audio,
            "store_dtype": self.store_dtype,
        }
        if self.text_storage != "padded":
            settings["text_storage"] = self.text_storage
        for name in ("video_batch", "vae_tiling", "text_quantize"):
            if getattr(self, name) != ADDED_LATER[name]:
                settings[name] = getattr(self, name)
        if self.buckets:
            settings["buckets"] = ";".join(f"{w}x{h}x{f}" for w, h, f in self.buckets)
        for name in ("shard_samples", "shard_bytes", "parquet_dtype"):
            if getattr(self, name) is not None:
                settings[name] = getattr(self, name)
        for name, key in (("start", "temporal_start"), ("window_step", "window_step"), ("short_clips", "short_clips")):
            if getattr(self, key) != ADDED_LATER[key]:
                settings[name] = getattr(self, key)
        if self.text_encoder_output in ("pre_connector", "post_connector"):
            settings["text_stage"] = self.text_encoder_output
        if self.layout == "cc12m":  # the one layout a user picks (fastvideo follows from the format)
            settings["layout"] = self.layout
        return settings

    def temporal_policy(self) -> Any:
        """The spec's temporal policy (an `infra.media.temporal.TemporalPolicy`)."""
        from infra.media.temporal import make_policy  # noqa: PLC0415 - config stays importable on its own

        return make_policy(self.temporal, self.temporal_start, self.window_step, self.short_clips)

    def text_settings(self) -> Any:
        """The family's text settings of this spec (an `infra.models.base.TextSettings`)."""
        from infra.models.base import TextSettings  # noqa: PLC0415 - config stays importable on its own

        return TextSettings(self.text_max_length, self.text_padding, self.text_encoder_output)

    def differences(self, other: CacheSpec) -> dict[str, tuple[Any, Any]]:
        """Field by field: {field: (mine, theirs)} where they differ."""
        mine, theirs = self.model_dump(mode="json"), other.model_dump(mode="json")
        keys = sorted(set(mine) | set(theirs))
        return {k: (mine.get(k), theirs.get(k)) for k in keys if mine.get(k) != theirs.get(k)}


def fingerprint_of(data: dict[str, Any]) -> str:
    """sha256 hex of canonical JSON."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML config file into a plain dict (keys use underscores, like the flags)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def merge_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> BuildConfig:
    """Flags win over the file; flags left unset (None) do not override."""
    merged = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    return BuildConfig.model_validate(merged)
