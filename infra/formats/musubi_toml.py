"""The dataset config beside a musubi cache (``OUT/musubi_dataset.toml``) and the one-dataset-per-directory rule.

musubi-tuner's dataset config (``dataset/config_utils.py`` at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7): a
video dataset names ``video_directory`` (what makes it a video dataset; its loader globs no video at training time),
``cache_directory``, ``target_frames`` and ``frame_extraction``; an image dataset ``image_directory``. Its
``resolution`` and ``enable_bucket = true`` (``bucket_no_upscale = false``) are what its ``BucketSelector``
recomputes each file's bucket with, the same buckets latentforge encoded to (`infra.media.buckets.musubi_buckets`),
so a ``batch_size`` above 1 stacks latents of one shape. ``generate_dataset_group_by_blueprint`` refuses two
datasets with one cache directory: one OUT holds one source's samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infra import outdir
from infra.cache.cachedir import CACHE_JSON, read_cache_json
from infra.errors import ConfigError
from infra.storage import atomic_write

TOML_NAME = "musubi_dataset.toml"
#: The cache files of the architectures latentforge writes (Wan's, HunyuanVideo 1.5's): musubi's own among them.
MUSUBI_SUFFIXES = ("_wan.safetensors", "_hv15.safetensors")


def toml_text(out: Path, spec: Any) -> str:
    """The dataset config for the cache at `out` made with `spec` (strings as JSON strings: valid TOML)."""
    where = json.dumps(str(Path(out).resolve()))
    dataset = (
        [f"image_directory = {where}"]
        if spec.frames == 1
        else [f"video_directory = {where}", f"target_frames = [{spec.frames}]", 'frame_extraction = "head"']
    )
    lines = [
        f"# musubi-tuner dataset config of the latent cache latentforge wrote here (fingerprint {spec.fingerprint()}).",
        "# Train with --dataset_config on this file. Do not run musubi's cache_latents or cache_text_encoder_outputs",
        "# on it: they list the video directory, find no video and, without --keep_cache, delete every cache file.",
        "# enable_bucket and resolution are the buckets the latents were made at: keep them.",
        "[general]",
        f"resolution = [{spec.width}, {spec.height}]",
        "enable_bucket = true",
        "bucket_no_upscale = false",
        "batch_size = 1",
        "num_repeats = 1",
        "",
        "[[datasets]]",
        *dataset,
        f"cache_directory = {where}",
    ]
    return "\n".join(lines) + "\n"


def write_toml(out: Path, spec: Any) -> None:
    """Write the config once, through the door to OUT (every shard's writer calls this; the same spec and OUT give
    the same bytes)."""
    data = toml_text(out, spec).encode()
    if outdir.is_file(out, TOML_NAME) and outdir.read_bytes(out, TOML_NAME) == data:
        return
    try:
        atomic_write(TOML_NAME, data, replace=False, out=out)
    except FileExistsError:  # another shard's writer was first: its bytes are these unless OUT moved
        if outdir.read_bytes(out, TOML_NAME) != data:
            atomic_write(TOML_NAME, data, replace=True, out=out)


def check_cache_directory(out: Path, source: str, suffix: str = "_wan.safetensors") -> None:
    """ConfigError when OUT is already the musubi cache directory of another dataset: a latentforge cache of another
    source, or musubi's own files (no cache.json; `suffix`: its latent files' ending for the architecture)."""
    if not out.is_dir():
        return
    if not outdir.is_file(out, CACHE_JSON):
        if any(entry.name.endswith((suffix, *MUSUBI_SUFFIXES)) for entry in outdir.entries(out)):
            raise ConfigError(
                f"--out {out} holds musubi cache files latentforge did not write: musubi-tuner takes one cache "
                "directory per dataset; give this source its own --out"
            )
        return
    try:
        theirs = str(read_cache_json(out).get("provenance", {}).get("source") or "")
    except (OSError, ValueError):
        return  # the conflict gate reports an unreadable cache.json
    if theirs and _where(theirs) != _where(source):
        raise ConfigError(
            f"--out {out} is the musubi cache directory of another dataset ({theirs}): musubi-tuner takes one cache "
            "directory per dataset (its loader refuses two that share one); give this source its own --out"
        )


def _where(source: str) -> str:
    """``KIND:PATH`` with a local PATH made absolute (the same source given two ways is one dataset)."""
    kind, _, path = source.partition(":")
    return f"{kind}:{path}" if "://" in path else f"{kind}:{Path(path).expanduser().resolve()}"
