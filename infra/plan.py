"""From a BuildConfig to a BuildPlan: family, checked geometry, spec, fingerprint, shards and quotas.

Everything here is cheap (JSON files, weight headers, tar headers) and runs before any model loads,
so a bad geometry or a wrong model path fails in seconds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from infra import outdir
from infra import records as read_back
from infra.bounds import seconds_list
from infra.cache import ledger, listing
from infra.cache.cachedir import read_cache_json
from infra.config import (
    ADDED_LATER,
    COPIED,
    TEMPORAL_ALIASES,
    BuildConfig,
    CacheSpec,
    spec_mark,
)
from infra.errors import ConfigError, ConflictError
from infra.fetch import local_model
from infra.formats import get_format
from infra.formats.consumers import (
    check_consumer,
    latent_norm_for,
    layout_for,
    layout_notes,
    preprocessing_for,
    refuse_unread,
    text_clean_for,
)
from infra.formats.shards import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_SAMPLES
from infra.job import Job
from infra.media.buckets import Bucket, check_reference_buckets, parse_buckets
from infra.media.image import IMAGE_POLICIES
from infra.media.resize import IMAGE_ONLY_POLICIES, RESIZE_POLICIES, resize_policy_of
from infra.media.resize import require as require_resize
from infra.media.still import CONSUMER_POLICIES
from infra.media.temporal import DEFAULT_SHORT, make_policy
from infra.models import (
    FAMILIES,
    FamilySpec,
    declared_modes,
    get_family,
    makers,
    mode_roles,
    model_identity,
    resolve_family,
)
from infra.models.base import GeometryRules, TextSettings, preprocess_name
from infra.outstore import is_url
from infra.recipes import apply_recipe
from infra.records import DamagedRecord
from infra.sources import SampleRef, Shard, ShardReadError, Source, ahead, listing_cache, open_source
from infra.sources.base import outside_source
from infra.sources.identity import SourceIdentity
from infra.sources.names import collision_key

logger = logging.getLogger(__name__)


class ShardPlan(BaseModel):
    """One shard and how many of its samples this run may take (None: all)."""

    model_config = ConfigDict(frozen=True)

    id: str
    path: str
    size: int = 0
    mtime_ns: int = 0
    version: str | None = None  # an object in a store: its version as listed (None: a local file)
    quota: int | None = None
    duplicates: dict[str, str] = {}  # key → SHARD/KEY of an earlier sample with the same group and id
    collisions: dict[str, str] = {}  # key → the earlier sample of another id whose output name it would take
    samples: int = 0  # samples this run will visit (counted at plan time)
    whole: bool = True  # the listing reached the shard's end (no quota stopped it, no damage cut it)
    damage: str | None = None  # what cut the listing short (a damaged tar), where something did

    @model_serializer(mode="wrap")
    def _without_absent_version(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("version") is None:  # a local source's recorded plan keeps the bytes it had
            data.pop("version", None)
        return data

    @property
    def shard(self) -> Shard:
        duplicates, collisions = tuple(sorted(self.duplicates.items())), tuple(sorted(self.collisions.items()))
        listed = {"size": self.size, "mtime_ns": self.mtime_ns, "version": self.version or ""}
        return Shard(id=self.id, path=self.path, **listed, duplicates=duplicates, collisions=collisions)


class BuildPlan(BaseModel):
    """A resolved run, the flows' object: the config, the job the stages below take (`infra.job.Job`), and the
    shards the plan listed. Nothing below the plan takes it: a stage gets the job (and the shards where it walks
    them), never the config (`tests/test_layout.py`)."""

    model_config = ConfigDict(frozen=True)

    config: BuildConfig
    #: What the stages below the plan take: the spec, fingerprint, shapes, kinds and run part, and the gates'
    #: decisions (an approved overwrite's `replace_from`, the stale gate's `stale_replace` / `stale_keep`).
    job: Job
    shards: list[ShardPlan]
    #: A build's plan: the spool its shards' samples were listed into (`infra.cache.listing`), recorded in OUT before
    #: the preprocess; None for a plan that records nothing (a step on an existing OUT, a dry run).
    listing: str | None = None
    #: The ids of every shard the source had when the plan listed it (before `--shard-filter`): what reconcile
    #: tells a shard gone from the source by, without listing it again; None for a plan that listed nothing.
    source_shards: tuple[str, ...] | None = None

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def out(self) -> outdir.Out:
        """OUT: a local folder, or a `StoreOut` for a URL (`infra.outdir.root`)."""
        return self.job.out

    @property
    def spec(self) -> CacheSpec:
        return self.job.spec

    @property
    def fingerprint(self) -> str:
        return self.job.fingerprint

    @property
    def family(self) -> str:
        return self.job.family

    @property
    def spool(self) -> Path | None:
        """The spool the plan listed its samples into (`listing`), as a path."""
        return None if self.listing is None else Path(self.listing)

    def decided(self, **decision: Any) -> BuildPlan:
        """The plan with a gate's decision in its job (`replace_from`, `stale_replace`, `stale_keep`)."""
        return self.model_copy(update={"job": self.job.model_copy(update=decision)})

    def settings_record(self, hidden: dict[str, Any]) -> dict[str, Any]:
        """The run's config as a record keeps it (JSON; the `hidden` fields of each section left out)."""
        return self.config.model_dump(mode="json", exclude=hidden)


def parse_only(only: list[str] | None) -> dict[str, frozenset[str] | None] | None:
    """``--only`` selectors → {shard id: sample keys, or None for the whole shard}; None selects everything.

    A selector is ``SHARD`` or ``SHARD/KEY`` (shard ids hold no ``/``; a key may)."""
    if only is None:
        return None
    chosen: dict[str, set[str] | None] = {}
    for selector in only:
        shard, _, key = selector.partition("/")
        if not shard:
            raise ConfigError(f"--only {selector!r}: expected SHARD or SHARD/KEY")
        if not key:
            chosen[shard] = None
        elif chosen.get(shard, set()) is not None:
            chosen.setdefault(shard, set()).add(key)  # type: ignore[union-attr]
    return {shard: frozenset(keys) if keys is not None else None for shard, keys in chosen.items()}


def _settings(config: BuildConfig, family: FamilySpec) -> dict[str, Any]:
    """The spec's settings: the user's, else the family's defaults; ConfigError for what the family cannot do."""
    given = config.encoding
    # a setting given wins; else the format's consumer's preprocessing (its resize, its reader's rotation); else the
    # family's default
    defaults = family.defaults | {"rotate": "stored"} | preprocessing_for(given.format, family.name)
    chosen = {k: getattr(given, k) if getattr(given, k) is not None else v for k, v in defaults.items()}
    if chosen["text_stage"] not in family.text_stages:
        raise ConfigError(
            f"--text-stage {chosen['text_stage']}: family {family.name} stores {', '.join(family.text_stages)}"
        )
    if config.encoding.text_storage == "trimmed" and (
        config.encoding.text_padding != "zeros" or not family.text_trimmable
    ):
        why = (
            f"family {family.name} stores pad rows that are not zeros"
            if not family.text_trimmable
            else "use it with --text-padding zeros (the rows past seq_len are then zeros)"
        )
        raise ConfigError(f"--text-storage trimmed keeps only the prompt's rows, restored exactly only as zeros: {why}")
    if config.encoding.audio and not family.has_audio:
        raise ConfigError(f"--audio: family {family.name} has no audio encoder")
    check_mode(config, family)
    if config.encoding.store_dtype not in family.store_dtypes:
        raise ConfigError(
            f"--store-dtype {config.encoding.store_dtype}: family {family.name} stores {', '.join(family.store_dtypes)}"
        )
    if family.resize_policies is not None and chosen["resize"] not in family.resize_policies:
        raise ConfigError(f"--resize {chosen['resize']}: family {family.name} does {', '.join(family.resize_policies)}")
    check_image_resize(config, family, chosen["resize"])
    require_resize(chosen["resize"])
    policy = make_policy(
        chosen["temporal"], config.encoding.start, config.encoding.window_step, config.encoding.short_clips
    )
    if config.encoding.buckets is not None and policy.kind != "head":
        raise ConfigError("--buckets choose among the first frames of a clip: use them with --temporal head")
    aligned = [role for role in ("reference_video", "video_mask") if role in family.roles(config.encoding.mode)]
    if aligned and policy.kind != "head":
        raise ConfigError(
            f"--mode {config.encoding.mode}: its {aligned[0]} is read from its first frames, as the trainer reads "
            f"every clip: use --temporal head (this run: {policy.name})"
        )
    chosen["temporal"] = policy.spec_value
    chosen["short_clips"] = None if policy.short == DEFAULT_SHORT[policy.kind] else policy.short
    return chosen


def check_image_resize(config: BuildConfig, family: FamilySpec, resize: str) -> None:
    """ConfigError for a resize policy the family's media has no code for, or a --resize given to a family that
    brings its own preprocessing (`FamilySpec.preprocess`: it replaces the policy)."""
    own = preprocess_name(family)
    if family.media != "image":
        if own is not None:
            raise ConfigError(f"family {family.name} declares a preprocess ({own}): only image families take one")
        if resize in IMAGE_ONLY_POLICIES:
            raise ConfigError(f"--resize {resize}: a policy for still images; family {family.name} encodes video")
    elif own is not None and config.encoding.resize is not None:
        raise ConfigError(f"--resize {resize}: family {family.name} preprocesses its images itself ({own})")
    elif own is None and resize not in IMAGE_POLICIES and resize not in CONSUMER_POLICIES:
        raise ConfigError(
            f"--resize {resize}: family {family.name} encodes still images, resized by {', '.join(IMAGE_POLICIES)}"
        )


def check_mode(config: BuildConfig, family: FamilySpec) -> None:
    """ConfigError for a mode this run cannot make: the family that makes it checks the run's settings
    (`FamilySpec.check`); a mode the family does not make, each family that makes it (the first refusal is raised:
    what is left is refused by the format's own checks)."""
    mode = config.encoding.mode
    for maker in [family] if mode in family.modes else makers(mode):
        maker.check(config.encoding)


def modes_reading(role: str, reads: bool = True) -> list[str]:
    """The declared modes whose samples read `role` (or, not `reads`, do not), in the order declared."""
    return [mode for mode in declared_modes() if (role in mode_roles(mode)) == reads]


def check_reference(config: BuildConfig, buckets: list[Bucket], rules: GeometryRules) -> None:
    """ConfigError for reference factors the run cannot use: given without a mode that reads a reference video, or
    breaking the trainer's rules for its reference buckets (`infra.media.buckets.check_reference_buckets`)."""
    enc = config.encoding
    factors = {
        "--reference-downscale-factor": enc.reference_downscale_factor,
        "--reference-temporal-scale-factor": enc.reference_temporal_scale_factor,
    }
    if "reference_video" not in mode_roles(enc.mode):
        for flag, factor in factors.items():
            if factor != 1:
                readers = " or ".join(modes_reading("reference_video"))
                raise ConfigError(
                    f"{flag} {factor} scales the reference video of --mode {readers} (this run: --mode {enc.mode})"
                )
        return
    check_reference_buckets(
        buckets,
        enc.reference_downscale_factor,
        enc.reference_temporal_scale_factor,
        rules.spatial_multiple,
        rules.frame_multiple,
    )


def video_batch(config: BuildConfig, temporal: str) -> int:
    """The spec's video batch (1 with --vae-slicing: the VAE then encodes each clip alone); ConfigError for a batch
    the shard cannot gather (``windows:K`` has no read-ahead)."""
    if config.encoding.video_batch > 1 and temporal.startswith("windows"):
        raise ConfigError("--video-batch batches samples prepared ahead; windows:K samples are not: use 1")
    return 1 if config.encoding.vae_slicing else config.encoding.video_batch


def check_text_8bit(config: BuildConfig, family: FamilySpec) -> None:
    """ConfigError for ``load_text_encoder_in_8bit`` for a family without it or a setting it cannot go with.
    Whether bitsandbytes and a CUDA device are there is checked where the run encodes (`flows.preflight`), not here:
    verifying an 8-bit cache needs neither."""
    if not config.encoding.load_text_encoder_in_8bit:
        return
    if not family.text_8bit:
        raise ConfigError(
            f"--load-text-encoder-in-8bit is the LTX-2 trainer's 8-bit Gemma (family ltx2); family {family.name} "
            "has no 8-bit text encoder"
        )
    if config.encoding.text_quantize != "none":
        raise ConfigError("--load-text-encoder-in-8bit and --text-quantize are two quantizations: give one")
    if config.run.text_offload:
        # bitsandbytes' int8 weights live on the GPU they were quantized on: parking them on the host is not offered
        raise ConfigError("--text-offload cannot park an 8-bit text encoder (bitsandbytes keeps it on its GPU)")


class Resolved(NamedTuple):
    """A BuildConfig resolved (`resolve`): the config with its recipe's settings filled in, and the job the stages
    take (the family, the spec, the shapes of a sample's latents (the first bucket's, with buckets) and text
    embeddings, the run part)."""

    config: BuildConfig
    job: Job


def resolve(config: BuildConfig) -> Resolved:
    """The one place below the flows that applies the recipe and turns a BuildConfig into what the stages take: the
    CacheSpec (resolve the family, check geometry and format, hash the model; the settings the spec takes as given,
    `COPIED`, are copied, the rest resolved here) in the Job (`infra.job`)."""
    config = apply_recipe(config)
    parts = model_parts(config)
    model_dir = local_model(config.model, parts)
    family = resolve_family(model_dir, config.family, config.encoding.audio)
    chosen = _settings(config, family)
    shaped = one_frame(config) if family.media == "image" else config  # a still is one frame, whatever --frames says
    derived = get_format(config.encoding.format).derived_buckets(shaped, chosen["temporal"])  # musubi's own
    given = parse_buckets(config.encoding.buckets) if config.encoding.buckets is not None else None
    buckets = derived or given
    geometry = (
        [(b.frames, b.height, b.width) for b in buckets]
        if buckets
        else [(config.encoding.frames, config.encoding.height, config.encoding.width)]
    )
    if family.media == "image":  # a still is one frame, whatever --frames says (the default is a video's 33)
        geometry = [(1, height, width) for _, height, width in geometry]
    rules = family.rules(model_dir)
    for frames, height, width in geometry if "video" in family.roles(config.encoding.mode) else ():  # audio only: none
        rules.check(family.name, frames, height, width)
    check_reference(config, [Bucket(w, h, f) for f, h, w in geometry], rules)
    check_text_8bit(config, family)
    frames, height, width = (
        (shaped.encoding.frames, config.encoding.height, config.encoding.width) if derived else geometry[0]
    )
    spec = CacheSpec(
        **{name: getattr(config.encoding, name) for name in COPIED},
        family=family.name,
        model_identity=model_identity(model_dir, family, config.encoding.identity_scheme, config.encoding.audio),
        frames=frames,
        height=height,
        width=width,
        buckets=[(b.width, b.height, b.frames) for b in buckets] if buckets else None,
        temporal=chosen["temporal"],
        start=config.encoding.start or 0,
        short_clips=chosen["short_clips"],
        resize=RESIZE_POLICIES[chosen["resize"]],
        rotate=chosen["rotate"],
        preprocess=preprocess_name(family),
        text_max_length=chosen["text_max_length"],
        text_stage=chosen["text_stage"],
        latent_norm=latent_norm_for(config.encoding.format, family.name, family.latent_norm),
        text_clean=text_clean_for(config.encoding.format, family.name),
        layout=layout_for(config),
        audio_durations=audio_durations(config),
        video_batch=video_batch(config, chosen["temporal"]),
        model_version=family.model_version(model_dir),
        conditioning=family.conditioning(model_dir, config.encoding.mode),
        **shard_settings(config),
    )
    refuse_unread(config.encoding.format, family.name)  # said before what the format has no place for
    placed = get_format(config.encoding.format, family.name).keys_for(family.name)
    if unplaced := [kind for kind in family.kinds(spec) if kind not in placed]:
        raise ConfigError(
            f"format {config.encoding.format} has no place for {', '.join(unplaced)} (family {family.name})"
        )
    check_consumer(spec, family.kinds(spec))
    out = outdir.of_setting(config.out)
    get_format(spec.format, spec.family).check_out(out, config.source)  # musubi: one dataset per OUT, a local one
    kinds = family.kinds(spec)
    resolved = {
        "family": family.name,
        "spec": spec,
        "fingerprint": spec.fingerprint(),
        "kinds": kinds,
        "latent_shape": family.latent_shape(model_dir, frames, height, width),
        "text_shape": family.text_shape(model_dir, TextSettings.of(spec)),
        # the VAE's steps, where a video mask is laid on the latents' grid (the decoders' `prepare.decode_media`)
        "mask_multiples": (rules.frame_multiple, rules.spatial_multiple) if "video_masks" in kinds else None,
    }
    return Resolved(config, Job.of(config, parts, **resolved))


def one_frame(config: BuildConfig) -> BuildConfig:
    """`config` with ``--frames 1``: what an image family's buckets are derived from."""
    return config.model_copy(update={"encoding": config.encoding.model_copy(update={"frames": 1})})


def model_parts(config: BuildConfig) -> tuple[str, ...]:
    """The components a model given by URL is fetched for (`infra.fetch`): its family's, or every family's when the
    family is told from the model (audio ones included: a few small folders)."""
    if not is_url(config.model):
        return ()
    if config.family is not None:
        return get_family(config.family).components_for(True)
    FAMILIES.load_plugins()
    return tuple(sorted({c for name in FAMILIES.names() for c in get_family(name).components_for(True)}))


def make_spec(config: BuildConfig) -> tuple[str, CacheSpec, tuple[int, ...], tuple[int, ...]]:
    """`resolve`'s (family, spec, latent shape, text shape): a command's check before its flow starts."""
    job = resolve(config).job
    return job.family, job.spec, job.latent_shape, job.text_shape


def audio_durations(config: BuildConfig) -> list[float] | None:
    """``--audio-durations`` as seconds (given in the order given, as the trainer parses them); ConfigError for a
    value that is not a positive number or a mode that is not audio-only."""
    text, mode = config.encoding.audio_durations, config.encoding.mode
    if text is None:
        return None
    if "video" in mode_roles(mode):
        raise ConfigError(
            f"--audio-durations: for the audio-only modes ({', '.join(modes_reading('video', reads=False))}); in "
            f"--mode {mode} a clip's audio follows its video"
        )
    return seconds_list(text, "--audio-durations")


def shard_settings(config: BuildConfig) -> dict[str, Any]:
    """The spec's shard layout: rotation (and the parquet dtype) for a shard format, nothing for the others."""
    if not get_format(config.encoding.format).sharded:
        return {}
    settings: dict[str, Any] = {
        "shard_samples": config.encoding.shard_samples or DEFAULT_SHARD_SAMPLES,
        "shard_bytes": config.encoding.shard_bytes or DEFAULT_SHARD_BYTES,
    }
    if config.encoding.format == "parquet":
        settings["parquet_dtype"] = config.encoding.parquet_dtype or "fp32"
    return settings


#: What the plan holds of each sample it lists, for the whole source (a source's samples may collide across its
#: shards): its shard, its key, and a digest of its id and output name, by the digest of its collision key (about
#: 300 bytes a sample, where the four strings took about 600: `bench/tar_memory_bench.py`).
Claim = tuple[str, str, bytes]


def _count_samples(
    samples: Iterator[SampleRef],
    shard: Shard,
    stop_at: int | None,
    stems: dict[bytes, Claim],
    add: Callable[[str, str, str], None],
    note: Callable[[str, str, str, SourceIdentity], None] | None = None,
    record: Callable[[Any], None] | None = None,
) -> tuple[int, dict[str, str], dict[str, str], str | None]:
    """How many of `samples` (the shard's, as its source lists them) this run visits in `shard`; {key: ``SHARD/KEY``}
    of those whose group and id an earlier sample has (a duplicate: refused, not encoded); {key: what it collides
    with} of those whose output name an earlier sample of another id has, up to case and Unicode normalisation
    (``a.mp4`` and ``a.mov``, ``Clip.mp4`` and ``clip.mp4``: refused, ``name_collision``, the first kept); the
    damage that cut the listing short. Output names go into `stems` (`Claim`s by the digest of their collision key);
    each sample counted is handed to `add` (key, id, group), to `note` with its source identity as listed, and to
    `record` as its listing found it."""
    count, duplicates, collisions, damage = 0, {}, {}, None
    with contextlib.closing(samples):  # type: ignore[type-var]  # a generator: its tar closed when counted
        try:
            for ref in samples:
                count += 1
                add(ref.key, ref.id, ref.group)
                if note is not None:
                    note(ref.key, ref.id, ref.group, ref.identity)
                if record is not None:
                    record(ref.listed)
                kind, first = _claim(stems, shard.id, ref) if ref.stem else (None, "")
                if kind is not None:
                    (duplicates if kind == "duplicate" else collisions)[ref.key] = first
                if stop_at is not None and count >= stop_at:
                    break
        except ShardReadError as exc:  # a damaged shard: counted up to the damage, reported by its task
            logger.warning("shard %s: %s", shard.id, exc)
            damage = str(exc)
    if duplicates or collisions:
        logger.warning(
            "shard %s: %d sample(s) duplicate earlier ones (group and id), %d collide with their output names",
            shard.id,
            len(duplicates),
            len(collisions),
        )
    return count, duplicates, collisions, damage


def _claim(stems: dict[bytes, Claim], shard_id: str, ref: SampleRef) -> tuple[str | None, str]:
    """Claim `ref`'s output name in `stems`: (None, "") when it is the first; ("duplicate", ``SHARD/KEY``) for the
    same group and id met before; ("collision", why) for another sample whose output name is the same up to case
    and Unicode form."""
    name = _digest(collision_key(ref.stem), 16)
    first = stems.setdefault(name, (shard_id, ref.key, _digest(f"{ref.id}\0{ref.stem}", 8)))
    if first[2] != _digest(f"{ref.id}\0{ref.stem}", 8):
        return "collision", (
            f"{ref.id!r} (output {ref.stem!r}) would share a file with {first[1]!r} in shard {first[0]}, met first: "
            "that one is encoded (output names are compared ignoring case and Unicode form)"
        )
    if first[:2] != (shard_id, ref.key):
        return "duplicate", f"{first[0]}/{first[1]}"
    return None, ""


def _digest(text: str, size: int) -> bytes:
    """`size` bytes of BLAKE2b of `text` (its UTF-8, a lone surrogate kept): two names with one digest are as
    unlikely as the disk flipping the bits of one into the other."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size).digest()


def _unrecorded(key: str, sid: str, group: str) -> None:
    """Where a plan that records nothing lists its samples."""


def plan_shards(
    config: BuildConfig, source: Source, spool: Path | None = None, listed: list[Shard] | None = None
) -> list[ShardPlan]:
    """Filter shards (`listed`: the source's, as listed already), count their samples (tar headers only) and apply
    the per-shard cap and --limit; with a `spool`, list each shard's planned samples into it
    (`infra.cache.listing`)."""
    listed = source.shards() if listed is None else listed
    shards = [s for s in listed if not config.selection.shard_filter or config.selection.shard_filter in s.id]
    if not shards:
        raise ConfigError(f"no shard of {config.source} matches --shard-filter {config.selection.shard_filter!r}")
    plans, left = [], config.selection.limit
    stems: dict[bytes, Claim] = {}
    ledgered = _ledgered(outdir.root(config.out)) if spool else frozenset()
    in_store = source.kind in listing_cache.TAR_KINDS and all(is_url(s.path) for s in shards)
    lister = functools.partial(ahead.list_shard, source)
    listings = (  # the caps known before any count: a store's tars listed at once (`infra.sources.ahead`)
        ahead.listed_ahead([(s, config.selection.max_samples_per_shard) for s in shards], lister)
        if in_store and left is None and len(shards) > 1
        else None
    )
    try:
        for shard in shards:
            if left is not None and left <= 0:
                break
            caps = [c for c in (left, config.selection.max_samples_per_shard) if c is not None]
            cap = min(caps) if caps else None
            if listings is not None:
                samples = next(listings).replay()
            else:
                samples = lister(shard, cap).replay() if in_store else source.samples(shard)
            spools = _Spools(spool, shard.id in ledgered, listing_cache.relistable(source.kind, shard.path))
            plans.append(_plan_shard(shard, samples, cap, stems, spools))
            if left is not None:
                left -= plans[-1].samples
    finally:
        if listings is not None:
            listings.close()
    return plans


class _Spools(NamedTuple):
    """What the plan spools of a shard (`infra.cache.listing`): its listing (with a spool), its samples' identities
    as listed (a resumed shard: for the stale check), its samples' records (a tar its task makes them again from:
    `infra.preprocess.kept`)."""

    spool: Path | None
    noting: bool
    recording: bool


def _plan_shard(
    shard: Shard, samples: Iterator[SampleRef], cap: int | None, stems: dict[bytes, Claim], spools: _Spools
) -> ShardPlan:
    """The shard's plan from its `samples` (up to `cap`), spooled as `spools` says."""
    spool = spools.spool
    with (
        listing.spool_shard(spool, shard.id) if spool else contextlib.nullcontext(_unrecorded) as add,
        listing.spool_identities(spool, shard.id) if spool and spools.noting else contextlib.nullcontext() as note,
        listing.spool_records(spool, shard.id) if spool and spools.recording else contextlib.nullcontext() as record,
    ):
        count, duplicates, collisions, damage = _count_samples(samples, shard, cap, stems, add, note, record)
    whole = damage is None and (cap is None or count < cap)
    listed = {"size": shard.size, "mtime_ns": shard.mtime_ns, "duplicates": duplicates, "collisions": collisions}
    listed |= {"version": shard.version or None, "whole": whole, "damage": damage}
    return ShardPlan(id=shard.id, path=shard.path, quota=cap, samples=count, **listed)


def _ledgered(out: outdir.Out) -> frozenset[str]:
    """The shards OUT has a ledger of (a resume's): the plan spools what their samples are listed as, for the stale
    check (`infra.cache.listing.spool_identities`); none where OUT has no ledger or cannot be read (its gates say
    why)."""
    try:
        return frozenset(ledger.shard_ids(out))
    except (OSError, ValueError, outdir.UnsafePath):
        return frozenset()


def make_plan(config: BuildConfig, spool: Path | None = None, shards: list[ShardPlan] | None = None) -> BuildPlan:
    """The whole plan for a build; its config has the recipe's settings filled in (`apply_recipe`). A build's plan
    lists its samples into `spool`, a directory outside OUT (`BuildPlan.listing`); given `shards` (a plan recorded
    in OUT), nothing is listed."""
    config, job = resolve(config)
    source_shards = None
    if shards is None:
        source = open_source(config.source, config.encoding)
        listed = source.shards()
        source_shards = tuple(s.id for s in listed)
        shards = plan_shards(config, source, spool, listed)
    for note in layout_notes(job.spec, shards):
        logger.info(note)
    return BuildPlan(
        config=config,
        job=job,
        shards=shards,
        listing=str(spool) if spool else None,
        source_shards=source_shards,
    )


def recorded_plan(config: BuildConfig) -> BuildPlan | None:
    """The plan OUT's newest build recorded when it began (its shards, as listed then) with `config`'s spec: what
    `latentforge reconcile` accounts for; None when OUT has no recorded plan."""
    follow = bool(config.encoding.follow_symlinks)
    shards = recorded_shards(outdir.root(config.out), config.source, follow)
    return None if shards is None else make_plan(config, shards=shards)


def recorded_shards(out: outdir.Out, source: str, follow_symlinks: bool = False) -> list[ShardPlan] | None:
    """The shards OUT's recorded plan names (None: it has none, or it does not read back), each checked, as any record
    read back is: an index with an entry that is not a shard plan is treated as absent with one warning line naming
    it (the next build records its plan anew: `listing.read_index`'s rule); a shard whose path is not a place of the
    source `source` (KIND:PATH; the containment of the source's own listing, `outside_source`) is left out with one
    warning line, never read."""
    entries = listing.read_index(out)
    if entries is None:
        return None
    where = outdir.shown(out, listing.INDEX_PATH)
    shards: list[ShardPlan] = []
    for number, entry in enumerate(entries):
        try:
            shard = ShardPlan.model_validate(entry)
        except ValueError as exc:
            why = f"its shard entry {number} is not a shard plan ({str(exc).splitlines()[0]})"
            read_back.warn(read_back.damaged(str(where), "a plan index", why, listing.ABSENT))
            return None
        outside = outside_source(source.partition(":")[2], shard.path, follow_symlinks=follow_symlinks)
        if outside is not None:
            logger.warning("%s: shard %s is not read and left out of the recorded plan: %s", where, shard.id, outside)
            continue
        shards.append(shard)
    return shards


def adopt_existing_spec(config: BuildConfig, planned: CacheSpec, out: Path) -> BuildConfig:
    """The config that reproduces the cache in OUT (reuse). Refused when the model differs: that would mix encoders."""
    existing = CacheSpec.model_validate(read_cache_json(out)["spec"])
    ours = planned.model_identity
    if existing.identity_scheme != planned.identity_scheme:  # the model's identity under the cache's own scheme
        model_dir = local_model(config.model, model_parts(config))
        ours = model_identity(model_dir, get_family(planned.family), existing.identity_scheme)
    if existing.model_identity != ours or existing.family != planned.family:
        raise ConflictError(
            f"reuse refused: {out} was made with another model ({existing.family}, {existing.model_identity}); "
            f"--model is {planned.family}, {ours}. Reusing it would mix latents of two encoders."
        )
    return config.with_values(**spec_settings(existing))


def config_for_out(out: Path, overrides: dict[str, Any]) -> BuildConfig:
    """A config to verify OUT against: its own cache.json's settings and model, with `overrides` on top."""
    values: dict[str, Any] = {}
    unreadable = f"has no readable cache.json that names one ({outdir.shown(out, 'cache.json')} names no model)"
    try:
        meta = read_cache_json(out)
        provenance = meta.get("provenance")
        provenance = provenance if isinstance(provenance, dict) else {}
        values = {
            "source": _text(provenance.get("source")),
            "model": _text(provenance.get("model_path")),
            **spec_settings(CacheSpec.model_validate(meta["spec"])),
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        why = str(exc) if isinstance(exc, DamagedRecord) else f"{outdir.shown(out, 'cache.json')}: {type(exc).__name__}"
        unreadable = f"has no readable cache.json ({why})"  # names the file and why, in one line
        logger.info("%s %s: verifying against the given settings only", out, unreadable)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if not values.get("model"):
        raise ConfigError(f"pass --model: {out} {unreadable}")
    values["source"] = values.get("source") or "none:-"  # verify needs no source; reconcile does
    return BuildConfig.model_validate({**values, "out": str(out)})


def _text(value: Any) -> str | None:
    """A string that cache.json names (a source, a model), or None for a value of another type (read back, not
    trusted)."""
    return value if isinstance(value, str) else None


def spec_settings(spec: CacheSpec) -> dict[str, Any]:
    """The BuildConfig settings that reproduce `spec` (reuse, verify against OUT's own cache.json): each setting of
    the spec (`Spec`: those copied from the config, those marked ``setting``) under its name, left out at its absent
    value (unless ``always``); the temporal, resize, buckets, durations, text stage and layout as the config spells
    them."""
    settings: dict[str, Any] = {}
    for name, field in CacheSpec.model_fields.items():
        mark, value = spec_mark(field), getattr(spec, name)
        if mark is None or not (mark.setting or name in COPIED):
            continue
        if mark.always or name not in ADDED_LATER or value != ADDED_LATER[name]:
            settings[name] = value
    settings["temporal"] = TEMPORAL_ALIASES.get(spec.temporal, spec.temporal)
    settings["resize"] = resize_policy_of(spec.resize)
    if spec.buckets:
        settings["buckets"] = ";".join(f"{w}x{h}x{f}" for w, h, f in spec.buckets)
    if spec.audio_durations:
        settings["audio_durations"] = ";".join(repr(d) for d in spec.audio_durations)
    if spec.text_stage in ("pre_connector", "post_connector"):
        settings["text_stage"] = spec.text_stage
    if spec.layout == "cc12m":  # the one layout a user picks (fastvideo follows from the format)
        settings["layout"] = spec.layout
    return settings
