"""What may happen when OUT already holds something: reuse, new_dir, overwrite or abort.

Nothing here asks a person: the flow does (a Prefect pause). These are the plain rules: the
overwrite token that binds an approval to one path, one old→new fingerprint change and what OUT held when it was
printed (its files' names, sizes and times: a listing, `held`), the next free ``OUT-vN`` directory, keeping the old
``cache.json``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from infra import outdir
from infra.cache.cachedir import CACHE_JSON
from infra.cache.ledger import LEDGER_DIR
from infra.cache.listing import INDEX, LISTINGS
from infra.cache.lock import LOCK_NAME
from infra.config import CacheSpec
from infra.outstore import StoreOut
from infra.plan import spec_settings
from infra.report_files import REPORTS_DIR
from infra.storage import atomic_write


class ConflictChoice(StrEnum):
    """The answers to "OUT holds something else: what now?". A timeout or no answer is abort."""

    abort = "abort"
    reuse = "reuse"
    new_dir = "new_dir"
    overwrite = "overwrite"


#: What a token that approves a change of OUT does not cover: latentforge's own bookkeeping, which a run rewrites
#: without changing anything an overwrite would replace (the writer lock, the reports each run adds, the plan each
#: build records when it begins).
NOT_COVERED = (LOCK_NAME, f"{LEDGER_DIR}/{INDEX}")
NOT_COVERED_DIRS = (REPORTS_DIR, f"{LEDGER_DIR}/{LISTINGS}")
#: A token: the path and the change (its first `CHANGE_DIGITS` hex digits), then what OUT held (the rest).
CHANGE_DIGITS, HELD_DIGITS = 12, 8


@dataclass(frozen=True)
class Held:
    """What OUT holds, as a token covers it: a digest of every entry's path, kind, size and version (a file's mtime, an
    object's ETag), taken from a listing (no byte read), and how many files and bytes that is."""

    digest: str
    files: int
    bytes: int

    def text(self) -> str:
        return f"{self.files} file(s), {self.bytes:,} bytes"


def held(out: Path | StoreOut) -> Held:
    """What OUT holds now (`Held`), but for `NOT_COVERED` and what is below `NOT_COVERED_DIRS`: the listing a token
    is bound to. Cost: one listing (measured for 10^4 files: RELIABILITY.md)."""
    digest, files, total = hashlib.sha256(), 0, 0
    root = outdir.root(out)
    if isinstance(root, Path) and root.exists() and not root.is_dir():  # a file where OUT should be: itself
        st = root.lstat()
        entries: list[outdir.Stat] = [("", "file", st.st_size, str(st.st_mtime_ns))]
    else:
        entries = outdir.stats(root)
    for rel, kind, size, version in entries:
        if rel in NOT_COVERED or rel in NOT_COVERED_DIRS or rel.startswith(tuple(f"{d}/" for d in NOT_COVERED_DIRS)):
            continue
        digest.update(f"{rel}\0{kind}\0{size}\0{version}\n".encode("utf-8", "surrogateescape"))
        files += kind != "dir"
        total += size
    return Held(digest.hexdigest(), files, total)


def overwrite_token(
    out: Path | StoreOut, old_fingerprint: str | None, new_fingerprint: str, now: Held | None = None
) -> str:
    """A short token bound to this path, this old→new change and what OUT holds `now` (`held`: taken here unless
    given): a stored token cannot approve another change, nor this one once OUT's files changed since it was
    printed (`same_change` tells the two apart)."""
    where = str(out) if outdir.is_store(out) else Path(out).expanduser().resolve()
    key = f"{where}\0{old_fingerprint or 'no-cache-json'}\0{new_fingerprint}"
    change = hashlib.sha256(key.encode()).hexdigest()[:CHANGE_DIGITS]
    return change + hashlib.sha256((now or held(out)).digest.encode()).hexdigest()[:HELD_DIGITS]


def same_change(given: str, token: str) -> bool:
    """Whether the token `given` approves the change `token` does, printed when OUT held something else."""
    return len(given) == len(token) and given[:CHANGE_DIGITS] == token[:CHANGE_DIGITS] and given != token


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
