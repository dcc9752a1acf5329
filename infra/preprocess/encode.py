"""Encode, the trip's third stage: a `PreparedSample` → an `EncodedSample` through the family's encoders (video
latents, prompt embedding, audio), with the token counts its ledger row records.

`encode_sample` runs the whole trip up to here for one sample alone: the one-sample sanity and the dry run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from infra.config import CacheSpec
from infra.devices import pin_cpu_threads, resolve_device, resolve_dtype
from infra.errors import InputError, ModelLoadError
from infra.faults import fault_point
from infra.formats import AUDIO_KIND, EncodedSample, textpad
from infra.formats.base import AUDIO_MASK_KIND, REFERENCE_KIND, STORE_DTYPES, kind_dtype
from infra.formats.consumers import latent_encoder
from infra.job import Job
from infra.media.audio import decode_audio
from infra.media.masks import audio_mask
from infra.media.prompts import CaptionRules
from infra.media.temporal import frames_seconds
from infra.models import LoadedFamily, load_family, memory
from infra.models.base import ROLE_MEDIA, ROLES, TextEmbedding, TextSettings
from infra.models.memory import LoadOptions
from infra.preprocess import vae_calls as videos
from infra.preprocess.prepare import PreparedSample, prepare
from infra.preprocess.read import read
from infra.preprocess.state import RunState, ShardState
from infra.preprocess.texts import TextCache
from infra.preprocess.timing import encode_timing
from infra.sources import SampleRef

#: The frame rate the LTX-2 trainer divides its longest bucket's frames by for a separate audio file's length.
TRAINER_AUDIO_FPS = 25.0
#: Where an audio kind's duration (seconds) goes in ``EncodedSample.info``, for the writer.
DURATION_KEYS = {kind: f"{role}_duration" for role, kind in ROLES.items() if ROLE_MEDIA[role] == "audio"}


@dataclass(frozen=True)
class Encoded:
    """A sample's encoded tensors (what every writer takes) and its prompt's token counts."""

    sample: EncodedSample
    tokens_total: int = 0
    truncated: bool = False


def load_encoder(job: Job) -> LoadedFamily:
    """The plan's family, loaded once per process on the configured device."""
    pin_cpu_threads(job.device)  # also for what the family computes while loading
    try:
        device, dtype = resolve_device(job.device), resolve_dtype(job.spec.dtype)
        return load_family(job.model_dir, job.family, device, dtype, load_options(job))
    except Exception as exc:
        raise ModelLoadError(f"cannot load {job.family} from {job.model}: {type(exc).__name__}: {exc}") from exc


def load_options(job: Job) -> LoadOptions:
    """The memory options a build loads its family with (the decode step reuses that same loaded family)."""
    return LoadOptions(
        vae_tiling=job.spec.vae_tiling,
        vae_slicing=job.vae_slicing,
        text_quantize=job.spec.text_quantize,
        text_offload=job.run.text_offload,
        text_8bit=job.spec.load_text_encoder_in_8bit,
    )


def shard_state(job: Job, run: RunState) -> ShardState:
    """The state a shard task's samples share, for `job` in `run` (its text cache bounded by ``--text-cache-mb``)."""
    return ShardState(run, TextCache(job.run.text_cache_mb * 2**20))


def encode_sample(ref: SampleRef, job: Job, encoder: LoadedFamily, state: ShardState | None = None) -> Encoded:
    """Read, prepare and encode one sample alone (the one-sample sanity, the dry run). Raises InputError for bad
    input."""
    prepared = prepare(read(ref, CaptionRules.of(job.spec)), job)
    fault_point("decode")
    return encode(prepared, job, encoder, state or shard_state(job, RunState("one-sample")))


def encode(prepared: PreparedSample, job: Job, encoder: LoadedFamily, state: ShardState) -> Encoded:
    """The sample's latents (batched with samples prepared ahead, ``--video-batch``), its prompt's embedding (held
    or batched, ``--text-batch``) and, for an audio spec, its audio latents.

    A clip without an audio track (or whose audio cannot be decoded) in an audio run is still encoded: its row
    records the missing audio with the reason (``extras["missing_outputs"]``), and reconciliation and the audio
    gate count it as a loss."""
    if prepared.video is None:
        return encode_audio_only(prepared, job, encoder, state)
    spec, video, ref = job.spec, prepared.video, prepared.ref
    pin_cpu_threads(job.device)  # the same kernels, so the same bytes, on every runner
    store = STORE_DTYPES[spec.store_dtype]
    consumer_view = latent_encoder(encoder, spec)  # latents as the format's consumer reads them
    with encode_timing(job.device):  # opt-in, for bench/gpu_bench.py; off: one environment lookup
        latents = videos.latents(consumer_view, prepared, job, state.batches, state.vae).to(store)
        with encode_timing(job.device, "text"):
            text = encode_text(encoder, prepared.prompt, job, state) if "text_embeddings" in job.kinds else None
    fault_point("encode")
    extras: dict[str, Any] = dict(text.extras) if text is not None else {}
    info: dict[str, Any] = {"fps": video.clip.fps, "geometry": tuple(int(n) for n in video.pixels.shape[2:])}
    info["sampling"] = prepared.sampling
    if prepared.reference is not None:  # IC-LoRA: the reference through the same VAE view, at the spec's batch size
        (reference,) = videos.encode_group(consumer_view, [prepared.reference.pixels], spec.video_batch, state.vae)
        if isinstance(reference, Exception):
            raise reference
        extras[REFERENCE_KIND] = reference.to(store)
        info["reference_fps"] = prepared.reference.clip.fps / spec.reference_temporal_scale_factor  # the trainer's
    extras.update(prepared.masks)
    if spec.conditioning is not None:  # --mode i2v of an image-to-video model: what its first frame conditions
        extras.update(conditioning_outputs(encoder, video.pixels, latents, spec.store_dtype))
    seconds = frames_seconds(spec, video.pixels.shape[2], video.clip.fps)
    made = [_audio(encoder, ref, prepared.media, seconds, spec)] if spec.audio else []
    for role, data in prepared.audio_roles.items():  # IC-LoRA: the reference's audio, by the audio column's rule
        made.append(_audio_file(encoder, data, ROLES[role], seconds, True, spec))
    for tensors, facts in made:
        extras.update(tensors)
        missing = {**info.get("missing_outputs", {}), **facts.pop("missing_outputs", {})}
        info.update(facts, **({"missing_outputs": missing} if missing else {}))
    embeds = None
    if text is not None:
        trimmed = spec.text_storage == "trimmed"
        embeds = (textpad.trim(text.embeds, text.seq_len) if trimmed else text.embeds).to(store)
    sample = EncodedSample(
        id=ref.id,
        group=ref.group,
        stem=ref.stem,
        prompt=prepared.prompt,
        latents=latents,
        text_embeds=embeds,
        seq_len=text.seq_len if text is not None else 0,
        source_shape=video.clip.source_shape,
        fingerprint=job.fingerprint,
        extras=extras,
        info=info,
    )
    return Encoded(sample, text.tokens_total, text.truncated) if text is not None else Encoded(sample)


def conditioning_outputs(
    encoder: LoadedFamily, pixels: torch.Tensor, latents: torch.Tensor, store_dtype: str
) -> dict[str, torch.Tensor]:
    """The family's image conditioning of a clip (`LoadedFamily.encode_conditioning`), each kind in its stored dtype."""
    made = encoder.encode_conditioning(pixels, latents)
    tensors = {f.name: getattr(made, f.name) for f in dataclasses.fields(made)}
    return {kind: t.to(kind_dtype(kind, store_dtype)) for kind, t in tensors.items() if t is not None}


def encode_audio_only(prepared: PreparedSample, job: Job, encoder: LoadedFamily, state: ShardState) -> Encoded:
    """An audio-only mode's sample (t2a, a2a-ic-lora, audio-inpaint), as the trainer's ``compute_audio_latents``
    with ``--audio-durations`` or without: its prompt, its audio file's latents (InputError when the file has no
    audio track or is shorter than every duration bucket: the sample has nothing to train on), a reference audio
    file's by the same rule (recorded missing when it has no track), an audio mask on the audio latents' steps."""
    spec, ref = job.spec, prepared.ref
    pin_cpu_threads(job.device)
    text = encode_text(encoder, prepared.prompt, job, state)
    fault_point("encode")
    extras: dict[str, Any] = dict(text.extras)
    info: dict[str, Any] = {"sampling": prepared.sampling}
    seconds = trainer_audio_seconds(prepared.media, spec.audio_durations)
    audio = encoder.encode_audio(prepared.media, seconds, False)
    if audio is None:  # decoded once already: not reached unless the file changed in between
        raise InputError("no_audio_track", "the audio file has no audio stream")
    extras[AUDIO_KIND], info["audio_duration"] = audio.latents, audio.duration
    if prepared.audio_mask is not None:
        extras[AUDIO_MASK_KIND] = audio_mask(prepared.audio_mask, int(audio.latents.shape[1]))
    for role, data in prepared.audio_roles.items():  # a reference audio file (a2a-ic-lora)
        kind = ROLES[role]
        try:  # its own bucket, as the trainer runs compute_audio_latents over each audio column alone
            other = encoder.encode_audio(data, trainer_audio_seconds(data, spec.audio_durations), False)
        except InputError as exc:  # shorter than every bucket, without a track, undecodable
            other, missing = None, f"{exc.reason}: {exc.detail}"
        else:
            missing = "no_audio_track: the file has no audio stream"
        if other is None:
            info.setdefault("missing_outputs", {})[kind] = missing
        else:
            extras[kind], info[DURATION_KEYS[kind]] = other.latents, other.duration
    sample = EncodedSample(
        id=ref.id,
        group=ref.group,
        stem=ref.stem,
        prompt=prepared.prompt,
        latents=None,
        text_embeds=text.embeds.to(STORE_DTYPES[spec.store_dtype]),
        seq_len=text.seq_len,
        source_shape=[],
        fingerprint=job.fingerprint,
        extras=extras,
        info=info,
    )
    return Encoded(sample, text.tokens_total, text.truncated)


def trainer_audio_seconds(data: bytes, durations: list[float] | None) -> float:
    """How long the trainer's ``compute_audio_latents`` keeps an audio-only sample's file: the longest of
    `durations` that fits in it, else (no durations) all of it; InputError ``no_audio_track``, ``audio_too_short``
    (shorter than every duration)."""
    wave = decode_audio(data)
    if wave is None:
        raise InputError("no_audio_track", "the audio file has no audio stream")
    if not durations:
        return (wave.samples.shape[-1] + 1) / wave.rate  # past its last sample: trimmed to nothing less
    fitting = [d for d in sorted(durations, reverse=True) if d <= wave.seconds]
    if not fitting:
        raise InputError(
            "audio_too_short",
            f"{wave.seconds:.3f} s of audio; the shortest --audio-durations bucket is {min(durations)} s",
        )
    return fitting[0]


def encode_text(encoder: LoadedFamily, prompt: str, job: Job, state: ShardState) -> TextEmbedding:
    """The prompt's embedding: held by the shard's text cache, or encoded now in one batch with the prompts read
    ahead (``--text-batch``, ``--text-cache-mb``)."""
    run, cache = job.run, state.texts
    upcoming = state.ahead.upcoming() if state.ahead is not None and run.text_cache_mb else []
    settings = TextSettings.of(job.spec)
    if run.text_offload:  # encoded in the shard's text phase; a prompt not held brings the parked encoder back
        held = cache.lookup(prompt, settings)
        if held is not None:
            return held
        with memory.text_in_use(encoder):
            return cache.embedding(encoder, prompt, settings, upcoming=upcoming, batch=run.text_batch)
    return cache.embedding(encoder, prompt, settings, upcoming=upcoming, batch=run.text_batch)


def _audio(
    encoder: LoadedFamily, ref: SampleRef, media: bytes, seconds: float, spec: CacheSpec
) -> tuple[dict[str, Any], dict[str, Any]]:
    """({audio_latents: tensor}, {audio_duration}) of the clip, or ({}, {missing_outputs: why it has none}). The
    clip's own track is `seconds` long (its F / fps, zero-padded when short); a separate audio file too, or under
    ``--audio-file-length trainer`` the trainer's length: the longest bucket's F / 25 seconds, never padded."""
    data = ref.read_audio() if ref.read_audio is not None else media
    if data is None:
        return {}, {"missing_outputs": {AUDIO_KIND: "missing_audio: the sample's audio file is not there"}}
    return _audio_file(encoder, data, AUDIO_KIND, seconds, ref.read_audio is not None, spec)


def _audio_file(
    encoder: LoadedFamily, data: bytes, kind: str, seconds: float, separate: bool, spec: CacheSpec
) -> tuple[dict[str, Any], dict[str, Any]]:
    """({kind: latents}, {duration: {kind: seconds}}) of one audio file (`separate`: a file of its own, under the
    length rule of ``--audio-file-length``), or ({}, {missing_outputs: {kind: why}})."""
    pad = True
    if separate and spec.audio_file_length == "trainer":  # an audio column, the trainer's rule
        longest = max(bucket[2] for bucket in spec.buckets) if spec.buckets else spec.frames
        seconds, pad = longest / TRAINER_AUDIO_FPS, False
    try:
        audio = encoder.encode_audio(data, seconds, pad)
    except InputError as exc:
        return {}, {"missing_outputs": {kind: f"{exc.reason}: {exc.detail}"}}
    if audio is None:
        return {}, {"missing_outputs": {kind: "no_audio_track: the file has no audio stream"}}
    return {kind: audio.latents}, {DURATION_KEYS[kind]: audio.duration}
