"""CacheSpec: what decides the bytes is in the fingerprint, and nothing else is."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.config import ADDED_LATER, COPIED, FINGERPRINT_NAMES, BuildConfig, CacheSpec
from infra.errors import ConfigError
from infra.models.base import GeometryRules
from infra.plan import make_spec, resolve, spec_settings

BASE = {
    "family": "wan22",
    "model_identity": {"vae": "a", "text_encoder": "b", "tokenizer": "c"},
    "format": "pt",
    "frames": 33,
    "height": 832,
    "width": 832,
    "temporal": "linspace",
    "dtype": "bf16",
    "text_max_length": 512,
    "text_padding": "zeros",
    "latent_norm": "norm",
}


def test_fingerprint_is_sha256_of_canonical_json():
    added = {"identity_scheme": "content", "audio": True, "buckets": [(96, 64, 9)], "start": 2}
    added |= {"shard_samples": 10, "shard_bytes": 1 << 20, "parquet_dtype": "fp32"}
    added |= {"video_batch": 2, "vae_tiling": True, "text_quantize": "int8-dynamic", "layout": "cc12m"}
    added |= {"mode": "i2v", "lora_trigger": "sks", "remove_llm_prefixes": True, "empty_captions": "encode"}
    added |= {"duplicate_rows": "last", "video_column": "v", "caption_column": "c", "audio_file_length": "trainer"}
    added |= {"follow_symlinks": True}
    added |= {"preprocess": "plugin:fn"}
    added |= {"load_text_encoder_in_8bit": True, "model_version": "2.5"}
    added |= {"reference_downscale_factor": 2, "reference_temporal_scale_factor": 2, "audio_durations": [2.0, 4.0]}
    added |= {"conditioning": "y", "text_clean": "whitespace", "rotate": "auto"}
    added |= {"max_timestep_boundary": 0.5, "min_timestep_boundary": 0.25}
    spec = CacheSpec(**{**BASE, **added, "window_step": 5, "short_clips": "skip", "text_storage": "trimmed"})
    as_0_1_named = {FINGERPRINT_NAMES.get(k, k): v for k, v in spec.model_dump(mode="json").items()}
    canonical = json.dumps(as_0_1_named, sort_keys=True, separators=(",", ":"))
    assert spec.fingerprint() == hashlib.sha256(canonical.encode()).hexdigest()


#: Fingerprints computed before the spec took the config's names (dtype, start, text_stage): existing caches resume.
KNOWN = [
    ({}, "8a1f6f9ccd1f2bec7fcddc862ad61995689798c168acd1db048ead893118460f"),
    (
        {"dtype": "fp32", "temporal": "stride:2", "start": 3, "text_stage": "pre_connector"}
        | {"identity_scheme": "content", "family": "ltx2"},
        "65e672b0e04bf2bd7a76ea9acde82d74bd5f015ddcfa67fcece92182c1fff846",
    ),
    (
        {"start": 0, "text_stage": "post_connector", "identity_scheme": "content", "audio": True, "video_batch": 2},
        "92f4150ecdb7babea8796d004901f87d121f7bd9709384aca7dda90e80f8198b",
    ),
]


@pytest.mark.parametrize(("changes", "fingerprint"), KNOWN)
def test_the_config_names_leave_every_fingerprint_as_it_was(changes, fingerprint):
    spec = CacheSpec(**{**BASE, **changes})
    assert spec.fingerprint() == fingerprint
    old_names = {FINGERPRINT_NAMES.get(k, k): v for k, v in spec.model_dump(mode="json").items()}
    loaded = CacheSpec.model_validate(old_names)  # a cache.json written before the rename
    assert loaded == spec and loaded.fingerprint() == fingerprint
    with pytest.raises(ValueError, match="twice"):
        CacheSpec.model_validate({**old_names, "dtype": spec.dtype})


def test_fields_added_since_0_1_at_their_absent_values_leave_the_fingerprint_as_0_1_computed_it():
    spec = CacheSpec(**BASE)  # identity_scheme sampled, no buckets, no audio: a cache.json of latentforge 0.1
    old = {FINGERPRINT_NAMES.get(k, k): v for k, v in spec.model_dump(mode="json").items() if k not in ADDED_LATER}
    assert (
        spec.fingerprint()
        == hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    )
    for field, value in (
        ("identity_scheme", "content"),
        ("audio", True),
        ("buckets", [(96, 64, 9)]),
        ("start", 3),
        ("window_step", 8),
        ("short_clips", "repeat"),
        ("shard_samples", 100),
        ("shard_bytes", 1 << 20),
        ("parquet_dtype", "bf16"),
        ("video_batch", 4),
        ("vae_tiling", True),
        ("text_quantize", "int8-dynamic"),
        ("mode", "i2v"),
        ("lora_trigger", "sks"),
        ("remove_llm_prefixes", True),
        ("empty_captions", "encode"),
        ("duplicate_rows", "last"),
        ("video_column", "clip"),
        ("caption_column", "text"),
        ("audio_file_length", "trainer"),
    ):
        assert CacheSpec(**{**BASE, field: value}).fingerprint() != spec.fingerprint(), field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_identity", {"vae": "other", "text_encoder": "b", "tokenizer": "c"}),
        ("frames", 29),
        ("height", 480),
        ("width", 480),
        ("dtype", "fp32"),
        ("text_max_length", 256),
        ("text_padding", "raw"),
        ("format", "other"),
        ("family", "ltx2"),
    ],
)
def test_every_byte_deciding_field_changes_the_fingerprint(field, value):
    base, changed = CacheSpec(**BASE), CacheSpec(**{**BASE, field: value})
    assert base.fingerprint() != changed.fingerprint()
    assert set(base.differences(changed)) == {field}


def test_run_options_do_not_change_the_fingerprint(tiny_model):
    common = {"source": "vbvr:/x", "model": str(tiny_model), "frames": 17, "height": 48, "width": 80}
    a = make_spec(BuildConfig(**common, out="/a", device="cpu", limit=3, workers=1))[1]
    b = make_spec(BuildConfig(**common, out="/b", device="auto", shard_filter="G-1", workers=4))[1]
    c = make_spec(BuildConfig(**common, out="/a", dtype="fp32"))[1]
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_unknown_spec_keys_are_refused():
    with pytest.raises(ValueError, match="extra"):
        CacheSpec(**BASE, colour="blue")


@pytest.mark.parametrize(
    ("frames", "height", "width", "message"),
    [
        (32, 48, 48, "frames=32 (needs frames ≡ 1 mod 4): nearest valid 29 or 33"),
        (1, 100, 48, "height=100 (needs a multiple of 16): nearest valid 96 or 112"),
        (5, 48, 8, "width=8 (needs a multiple of 16): nearest valid 16"),
    ],
)
def test_geometry_rules_name_bad_values_and_nearest_valid_ones(frames, height, width, message):
    with pytest.raises(ConfigError) as caught:
        GeometryRules(frame_multiple=4, frame_remainder=1, spatial_multiple=16).check("wan22", frames, height, width)
    assert message in str(caught.value)


def test_valid_geometry_passes():
    GeometryRules(4, 1, 16).check("wan22", 33, 832, 480)
    GeometryRules(4, 1, 16).check("wan22", 1, 16, 16)


#: The hand-written lists the fields' `Spec` metadata replaced, frozen as they were: a derived list that drifts from
#: them changes fingerprints (ADDED_LATER, FINGERPRINT_NAMES), the spec's bytes (COPIED) or what a reuse restates.
HAND_ADDED_LATER = {
    "identity_scheme": "sampled", "buckets": None, "audio": False, "shard_samples": None, "shard_bytes": None,
    "parquet_dtype": None, "start": 0, "window_step": None, "short_clips": None, "text_storage": "padded",
    "video_batch": 1, "vae_tiling": False, "text_quantize": "none", "load_text_encoder_in_8bit": False,
    "model_version": None, "layout": None, "mode": "t2v", "audio_file_length": "clip", "lora_trigger": None,
    "remove_llm_prefixes": False, "empty_captions": "skip", "duplicate_rows": "refuse", "video_column": None,
    "caption_column": None, "follow_symlinks": False, "preprocess": None, "reference_downscale_factor": 1,
    "reference_temporal_scale_factor": 1, "audio_durations": None, "conditioning": None, "text_clean": None,
    "rotate": "stored", "max_timestep_boundary": 1.0, "min_timestep_boundary": 0.0,
}  # fmt: skip
HAND_FINGERPRINT_NAMES = {"dtype": "compute_dtype", "start": "temporal_start", "text_stage": "text_encoder_output"}
#: make_spec's keywords taken from the config as given (its own, caption_settings', memory and 8-bit settings').
HAND_COPIED = {
    "identity_scheme", "format", "window_step", "audio", "dtype", "store_dtype", "text_padding", "text_storage",
    "vae_tiling", "text_quantize", "load_text_encoder_in_8bit", "mode", "lora_trigger", "remove_llm_prefixes",
    "empty_captions", "duplicate_rows", "video_column", "caption_column", "audio_file_length",
    "reference_downscale_factor", "reference_temporal_scale_factor", "follow_symlinks", "max_timestep_boundary",
    "min_timestep_boundary",
}  # fmt: skip
#: spec_settings: the settings it always restated, and those it restated only away from their absent values.
HAND_RESTATED = {
    "family", "format", "frames", "height", "width", "temporal", "resize", "dtype", "text_max_length", "text_padding",
    "identity_scheme", "audio", "store_dtype", "rotate",
}  # fmt: skip
HAND_RESTATED_WHEN_USED = {
    "text_storage", "video_batch", "vae_tiling", "text_quantize", "start", "window_step", "short_clips", "mode",
    "lora_trigger", "remove_llm_prefixes", "empty_captions", "duplicate_rows", "video_column", "caption_column",
    "audio_file_length", "load_text_encoder_in_8bit", "reference_downscale_factor", "reference_temporal_scale_factor",
    "audio_durations", "follow_symlinks", "buckets", "shard_samples", "shard_bytes", "parquet_dtype", "text_stage",
    "layout", "max_timestep_boundary", "min_timestep_boundary",
}  # fmt: skip
#: The spec's fields that a spec without them cannot leave out, and the defaults of the others.
HAND_REQUIRED = {"family", "model_identity", "format", "frames", "height", "width", "temporal", "dtype"}
HAND_REQUIRED |= {"text_max_length", "text_padding", "latent_norm"}
HAND_DEFAULTS = HAND_ADDED_LATER | {
    "spec_version": 1, "resize": "bilinear-align_corners_false", "store_dtype": "bf16",
    "text_stage": "last_hidden_state",
}  # fmt: skip
USED = {
    "text_storage": "trimmed", "video_batch": 2, "vae_tiling": True, "text_quantize": "int8-dynamic", "start": 3,
    "window_step": 4, "short_clips": "skip", "mode": "i2v", "lora_trigger": "sks", "remove_llm_prefixes": True,
    "empty_captions": "encode", "duplicate_rows": "last", "video_column": "v", "caption_column": "c",
    "audio_file_length": "trainer", "load_text_encoder_in_8bit": True, "reference_downscale_factor": 2,
    "reference_temporal_scale_factor": 2, "audio_durations": [2.0], "follow_symlinks": True,
    "buckets": [(96, 64, 9)], "shard_samples": 5, "shard_bytes": 1 << 20, "parquet_dtype": "bf16",
    "text_stage": "pre_connector", "layout": "cc12m", "max_timestep_boundary": 0.5, "min_timestep_boundary": 0.25,
}  # fmt: skip


def test_the_lists_derived_from_each_fields_spec_metadata_are_the_hand_written_ones_they_replaced():
    assert ADDED_LATER == HAND_ADDED_LATER
    assert FINGERPRINT_NAMES == HAND_FINGERPRINT_NAMES
    assert set(COPIED) == HAND_COPIED
    fields = CacheSpec.model_fields
    assert {name for name, field in fields.items() if field.is_required()} == HAND_REQUIRED
    assert {name: field.default for name, field in fields.items() if not field.is_required()} == HAND_DEFAULTS
    assert set(spec_settings(CacheSpec(**BASE))) == HAND_RESTATED
    assert set(spec_settings(CacheSpec(**BASE, **USED))) == HAND_RESTATED | HAND_RESTATED_WHEN_USED


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.fixed_dictionaries(
        {},
        optional={
            "lora_trigger": st.sampled_from(["sks", "a b"]),
            "remove_llm_prefixes": st.booleans(),
            "empty_captions": st.sampled_from(["skip", "encode"]),
            "duplicate_rows": st.sampled_from(["refuse", "last"]),
            "video_column": st.just("clip"),
            "caption_column": st.just("text"),
            "follow_symlinks": st.booleans(),
            "audio_file_length": st.sampled_from(["clip", "trainer"]),
            "vae_tiling": st.booleans(),
            "dtype": st.sampled_from(["bf16", "fp32"]),
            "identity_scheme": st.sampled_from(["content", "sampled"]),
            "temporal": st.sampled_from(["span", "head", "stride:2", "fps:8"]),
            "video_batch": st.integers(1, 2),
            "text_storage": st.just("trimmed"),
        },
    )
)
def test_a_cache_restated_as_settings_plans_the_same_spec(tiny_model, changes):
    """What a reuse or a verify of OUT does: the spec's settings (`spec_settings`), planned again, give the spec."""
    common = {"source": "vbvr:/x", "model": str(tiny_model), "out": "/a", "frames": 5, "height": 32, "width": 32}
    if "text_storage" in changes:
        changes["text_padding"] = "zeros"
    if changes.get("temporal") == "stride:2":
        changes["start"] = 2
    spec = make_spec(BuildConfig(**common, **changes))[1]
    again = make_spec(BuildConfig(**common | spec_settings(spec)))[1]
    assert again == spec and again.fingerprint() == spec.fingerprint()


def test_resolve_gives_the_spec_and_the_stages_job_a_frozen_picklable_part(tiny_model):
    """`resolve` applies the recipe and splits the config: the spec (what decides the bytes) and the job (the run's
    part the stages read): --vae-slicing makes the spec's batch 1 while the job still gathers --video-batch clips."""
    values = {"source": "vbvr:/x", "model": str(tiny_model), "out": "/a", "frames": 5, "height": 32, "width": 32}
    values |= {"recipe": "wan22-vbvr", "video_batch": 2, "vae_slicing": True, "max_frames": 99, "device": "cpu"}
    config, job = resolve(BuildConfig(**values))
    assert config.encoding.text_padding == "raw" == job.spec.text_padding  # the recipe's
    assert (job.spec.video_batch, job.gather, job.vae_slicing) == (1, 2, True)
    assert job.limits.max_frames == 99 and job.device == "cpu" and job.out == Path("/a")
    assert job.fingerprint == job.spec.fingerprint() and job.kinds == ("latents", "text_embeddings")
    assert job.video and job.mask_multiples is None  # no video mask in this mode: the decoders lay none
    back = pickle.loads(pickle.dumps(job))  # what a Ray worker and a decoder process are handed
    assert back == job and back.spec.fingerprint() == job.fingerprint and back.model_dir == job.model_dir
    assert job.placed("cuda:1").device == "cuda:1" != job.device
    with pytest.raises(ValueError, match="frozen"):
        job.gather = 3
