"""What may happen when OUT already holds something: reuse, new_dir, overwrite or abort.

Nothing here asks a person: the flow does (a Prefect pause). These are the plain rules: the
overwrite token that binds an approval to one path and one old→new fingerprint change, the next
free ``OUT-vN`` directory, keeping the old ``cache.json``.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum
from pathlib import Path
from typing import Any

from infra import outdir
from infra.cache.cachedir import CACHE_JSON
from infra.config import CacheSpec
from infra.outstore import StoreOut
from infra.plan import spec_settings
from infra.storage import atomic_write


class ConflictChoice(StrEnum):
    """The answers to "OUT holds something else: what now?". A timeout or no answer is abort."""

    abort = "abort"
    reuse = "reuse"
    new_dir = "new_dir"
    overwrite = "overwrite"


def overwrite_token(out: Path, old_fingerprint: str | None, new_fingerprint: str) -> str:
    """A short token bound to this path and this old→new change: a stored token cannot approve another."""
    where = str(out) if outdir.is_store(out) else Path(out).expanduser().resolve()
    key = f"{where}\0{old_fingerprint or 'no-cache-json'}\0{new_fingerprint}"
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def next_free_dir(out: Path) -> Path:
    """OUT-v2, OUT-v3, ...: the first that does not exist (never a directory that exists)."""
    out = outdir.root(out)
    version = 2
    if isinstance(out, StoreOut):  # a prefix is free while no object is below it
        while outdir.entries(candidate := StoreOut(f"{out.url}-v{version}")):
            version += 1
        return candidate
    while (candidate := out.with_name(f"{out.name}-v{version}")).exists():
        version += 1
    return candidate


def settings_that_differ(existing: CacheSpec, planned: CacheSpec) -> dict[str, tuple[Any, Any]]:
    """The build settings (by flag name, ``text_max_length`` for ``--text-max-length``) whose values make two specs
    differ: {name: (existing, planned)}. Empty when only the model differs."""
    old, new = spec_settings(existing), spec_settings(planned)
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def same_model(existing: CacheSpec, planned: CacheSpec) -> bool:
    """Whether the two specs name the same family and model (by identity, under the same scheme): only then can
    the existing cache be reused."""
    same_scheme = existing.identity_scheme == planned.identity_scheme
    return existing.family == planned.family and (not same_scheme or existing.model_identity == planned.model_identity)


def flag(name: str) -> str:
    """A setting's command-line flag: ``text_max_length`` → ``--text-max-length``."""
    return "--" + name.replace("_", "-")


#: The name `keep_old_cache_json` gives the cache.json of a replaced cache (the first 16 digits of its fingerprint).
KEPT_SPEC = re.compile(r"^cache\.(?:[0-9a-f]{16}|unknown)\.json$")


def keep_old_cache_json(out: Path, old_fingerprint: str | None) -> Path | None:
    """Before an approved overwrite: copy cache.json to cache.<old fp>.json (a record), then let it be replaced."""
    if outdir.lstat(out, CACHE_JSON) is None:
        return None
    record = f"cache.{(old_fingerprint or 'unknown')[:16]}.json"
    if outdir.lstat(out, record) is None:
        atomic_write(record, outdir.read_bytes(out, CACHE_JSON), out=out)
    return outdir.root(out) / record
