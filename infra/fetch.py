"""A model named by URL (``--model hf://ORG/NAME[@revision]``, ``s3://BUCKET/PREFIX``, any fsspec URL), fetched
once per machine into a local cache: only the files the cache depends on (the family's components and the JSON
files that describe the model), never the rest of the repository (a Wan2.2 repo's 28 GB transformer).

The Hub through `huggingface_hub.snapshot_download` (its own cache under ``HF_HOME``, ``allow_patterns`` for the
parts; resumable, shared with every other Hub tool on the machine); any other store through fsspec into
``$LATENTFORGE_CACHE_DIR/models`` (else ``$XDG_CACHE_HOME/latentforge/models``), in a folder named by the URL and the
listing of what was fetched (each object's size and version), so a changed object is fetched again into a new
folder, never mixed with the old. The files on disk are the model's own bytes: the fingerprint is the one of the same
files in a local folder. A local path is returned as it is.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infra.errors import ConfigError
from infra.outstore import is_url
from infra.runtime import machine_cache
from infra.urls import store_settings_problem, url_problem

logger = logging.getLogger(__name__)

#: The keys of an object's listing that name its version, most specific first (S3, GCS, the Hub, others).
VERSION_KEYS = ("VersionId", "generation", "blob_id", "ETag", "etag", "md5Hash", "checksum")
#: The files that describe a model beside its components (model_index.json, each component's config).
DESCRIPTION = ("*.json",)
MANIFEST = ".latentforge-fetched.json"


def version_of(info: dict[str, Any]) -> str:
    """The version an object's listing (fsspec's ``info``) gives (`VERSION_KEYS`, a Hub LFS file's sha256), as
    text; "" when it gives none."""
    lfs = info.get("lfs")
    if isinstance(lfs, dict) and lfs.get("sha256"):
        return f"sha256:{lfs['sha256']}"
    for key in VERSION_KEYS:
        if info.get(key):
            return str(info[key]).strip('"')
    return ""


def patterns(parts: Iterable[str]) -> list[str]:
    """The fetch patterns of a model's components `parts` (folders) and its description files."""
    return [*DESCRIPTION, *(f"{part}/*" for part in sorted(set(parts)))]


def local_model(model: str, parts: Iterable[str] = ()) -> Path:
    """The local folder of `model`: a local path as given; a URL's components `parts` fetched once per machine."""
    if not is_url(model):
        return Path(model).expanduser()
    problem = url_problem(model) or store_settings_problem([model], dict(os.environ))
    if problem is not None:  # the model's URL is recorded in OUT: it holds no secret; a store setting checked first
        raise ConfigError(f"--model: {problem}")
    return _fetched(model, tuple(sorted(set(parts))))


@functools.lru_cache(maxsize=8)
def _fetched(url: str, parts: tuple[str, ...]) -> Path:
    scheme = url.split("://", 1)[0].lower()
    try:
        return _from_hub(url, parts) if scheme == "hf" else _from_store(url, parts)
    except ImportError as exc:
        extra = {"gs": "gcs", "gcs": "gcs", "hf": "hub"}.get(scheme, "s3")
        hint = f"pip install 'latentforge[{extra}]'"
        raise ConfigError(f"--model {scheme}://: a library is missing ({exc}): {hint}") from exc


def _from_hub(url: str, parts: tuple[str, ...]) -> Path:
    """``hf://ORG/NAME[@revision]`` as a snapshot in the Hub's cache (only `parts` and the description files)."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - only a model on the Hub needs it

    name, _, revision = url.removeprefix("hf://").strip("/").partition("@")
    if name.count("/") != 1:
        raise ConfigError(f"--model {url}: expected hf://ORG/NAME[@revision]")
    # huggingface_hub reads HF_ENDPOINT and HF_HOME once, at import: read here at call time, as the Hub tools do
    endpoint = os.environ.get("HF_ENDPOINT") or None
    home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_HUB_CACHE") or (str(Path(home).expanduser() / "hub") if home else None)
    try:
        path = snapshot_download(
            name,
            revision=revision or None,
            allow_patterns=patterns(parts),
            endpoint=endpoint,
            cache_dir=cache,
            repo_type="model",
        )
    except OSError as exc:  # the Hub's errors (no such repo, no access, offline) are OSErrors
        raise ConfigError(f"--model {url}: cannot be fetched from the Hub ({type(exc).__name__}: {exc})") from exc
    logger.info("model %s: snapshot at %s", url, path)
    return Path(path)


def cache_root() -> Path:
    return machine_cache("models")


def _from_store(url: str, parts: tuple[str, ...]) -> Path:
    """A model under a store prefix: the objects `patterns(parts)` match, fetched into a folder of the local cache
    named by the URL and their listing (an object changed in the store: a new folder)."""
    import fsspec  # noqa: PLC0415 - only a model in a store needs it

    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    try:
        found = fs.find(root, detail=True)
    except OSError as exc:
        raise ConfigError(f"--model {url}: cannot be listed ({exc})") from exc
    wanted = patterns(parts)
    listing = {}
    for path, info in found.items():
        rel = path[len(root) :].lstrip("/")
        if any(fnmatch.fnmatch(rel, p) for p in wanted):
            listing[rel] = (int(info.get("size") or 0), version_of(info), path)
    if not listing:
        raise ConfigError(f"--model {url}: no model files there ({', '.join(wanted)})")
    stamp = json.dumps({"url": url, "files": {r: v[:2] for r, v in sorted(listing.items())}}, sort_keys=True)
    target = cache_root() / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    if (target / MANIFEST).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetching-", dir=target.parent))
    try:
        for rel, (_, _, path) in sorted(listing.items()):
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(staging / rel))
        (staging / MANIFEST).write_text(stamp, encoding="utf-8")
        try:
            staging.rename(target)  # another process of this machine may have fetched it first: theirs is kept
        except OSError:
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("model %s: %d files fetched into %s", url, len(listing), target)
    return target
