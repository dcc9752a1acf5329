"""The cache root: ``cache.json`` (spec + fingerprint + provenance) and what OUT holds now.

``cache.json`` is written once, before the first sample, and never rewritten: it declares what the
directory holds, so a crashed first run is still recognised as this cache on the rerun.

Below an OUT in an object store ``cache.json`` is written last (`finish_cache_json`, when the run's writes end), so
that a reader never finds one whose data is not there yet: before the first sample the same bytes go to
``ledger/cache.pending.json`` (`PENDING_JSON`), which is what recognises a crashed run's OUT as this cache (`classify`,
`read_cache_json`), copied to ``cache.json`` and deleted at the end. A local OUT keeps its order (its bytes unchanged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError

from infra import outdir, records
from infra.cache.lock import LOCK_NAME
from infra.config import CacheSpec
from infra.outstore import StoreOut
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

CACHE_JSON = "cache.json"
#: Below an OUT in an object store: cache.json as a run that has not ended writes it (copied to cache.json last).
PENDING_JSON = "ledger/cache.pending.json"
OutKind = Literal["absent", "compatible", "incompatible", "foreign", "damaged"]


@dataclass
class OutState:
    """What OUT holds, compared with the planned spec."""

    kind: OutKind
    message: str
    differences: dict[str, Any] = field(default_factory=dict)
    existing_fingerprint: str | None = None


def read_cache_json(out: Path) -> dict[str, Any]:
    """The parsed cache.json (raises FileNotFoundError / ValueError); in a store, the pending one of a run that has
    not ended where there is one (what that run declares: a new cache, or an approved overwrite of the cache.json
    still there), else cache.json."""
    if outdir.is_store(out):
        with contextlib.suppress(FileNotFoundError):
            return _parsed(out, PENDING_JSON, outdir.read_bytes(out, PENDING_JSON))
    return _parsed(out, CACHE_JSON, outdir.read_bytes(out, CACHE_JSON))


#: What answers a cache.json that does not read back (it is what OUT declares: never rebuilt on a guess).
CACHE_JSON_REPAIR = "`latentforge verify OUT` with the build's settings prints the answers (an overwrite's token)"


def _parsed(out: Path | StoreOut, rel: str, data: bytes) -> dict[str, Any]:
    """cache.json's bytes `data` parsed, bounded (`infra.records`): a JSON object, else a one-line DamagedRecord."""
    where = outdir.shown(out, rel)
    value = records.loads(data, where, "a cache.json", CACHE_JSON_REPAIR)
    if not isinstance(value, dict):
        raise records.damaged(where, "a cache.json", f"a JSON {type(value).__name__}, not an object", CACHE_JSON_REPAIR)
    return value


def has_cache_json(out: Path | StoreOut) -> bool:
    """OUT declares a cache: its cache.json, or in a store the pending one of a run that has not ended."""
    if outdir.lstat(out, CACHE_JSON) is not None:
        return True
    return outdir.is_store(out) and outdir.lstat(out, PENDING_JSON) is not None


def overwrite_in_progress(meta: Mapping[str, Any], done: Mapping[str | None, int]) -> dict[str, Any] | None:
    """An approved overwrite not finished yet: ``{"from": the replaced fingerprint, "pending": its done samples
    still in the ledgers}``, or None. `meta` is cache.json (an approved overwrite writes the fingerprint it replaces
    into its provenance, before the first sample is replaced); `done` the ledgers' done samples per fingerprint. Such
    a cache is this cache, an approved change half made: the next build of its spec resumes the change."""
    provenance = meta.get("provenance") if isinstance(meta, Mapping) else None
    old = provenance.get("replaces") if isinstance(provenance, Mapping) else None
    pending = done.get(old, 0) if isinstance(old, str) and old and old != meta.get("fingerprint") else 0
    return {"from": old, "pending": pending} if pending else None


def write_cache_json(out: Path, spec: CacheSpec, provenance: dict[str, Any], *, replace: bool = False) -> Path:
    """Create cache.json (replaces an existing one only when told: an approved overwrite). In a store it is the
    pending one (an overwrite's over a pending one there), made cache.json by `finish_cache_json` when the run's writes
    end."""
    body = {
        "fingerprint": spec.fingerprint(),
        "spec": spec.model_dump(mode="json"),
        "provenance": {
            **provenance,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }
    text = json.dumps(body, indent=2, sort_keys=True) + "\n"
    rel = PENDING_JSON if outdir.is_store(out) else CACHE_JSON
    return atomic_write(rel, text.encode(), replace=replace, out=out).path


def finish_cache_json(out: Path | StoreOut) -> None:
    """In a store, when a run's writes end: the pending cache.json becomes cache.json (its bytes, one PUT, never over
    one there but the cache.json an approved overwrite replaces), then the pending one is deleted. Nothing to do for
    a local OUT or where nothing is pending."""
    if not outdir.is_store(out):
        return
    try:
        data = outdir.read_bytes(out, PENDING_JSON)
    except FileNotFoundError:
        return
    if _replaces(out, data):  # an approved overwrite: its cache.json over the one it replaces
        atomic_write(CACHE_JSON, data, replace=True, out=out)
    else:
        with contextlib.suppress(FileExistsError):  # a run stopped before it deleted the pending one wrote it
            atomic_write(CACHE_JSON, data, out=out)
    outdir.unlink(out, PENDING_JSON)


def _replaces(out: Path | StoreOut, pending: bytes) -> bool:
    """Whether the pending cache.json `pending` is an approved overwrite of OUT's cache.json (its provenance names
    the fingerprint that one declares, and it is not these bytes already)."""
    try:
        replaces = (_parsed(out, PENDING_JSON, pending).get("provenance") or {}).get("replaces")
        if not replaces:  # a new cache's (no read of cache.json)
            return False
        there = outdir.read_bytes(out, CACHE_JSON)
        return there != pending and _parsed(out, CACHE_JSON, there).get("fingerprint") == replaces
    except (OSError, ValueError, AttributeError):
        return False


def _visible_entries(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if p.name != LOCK_NAME]


def classify(out: Path, spec: CacheSpec) -> OutState:
    """absent / compatible / incompatible / foreign / damaged, with what differs."""
    out = outdir.root(out)
    if outdir.is_store(out):  # a prefix: absent while no object is below it (but the lease)
        if not [e for e in outdir.entries(out) if e.name != LOCK_NAME]:
            return OutState("absent", f"{out} does not exist or is empty")
    elif not out.exists() or (out.is_dir() and not _visible_entries(out)):
        return OutState("absent", f"{out} does not exist or is empty")
    elif not out.is_dir():
        return OutState("foreign", f"{out} exists and is not a directory")
    try:
        if not has_cache_json(out):
            return OutState("foreign", f"{out} holds files but no {CACHE_JSON}: not written by latentforge")
        existing = read_cache_json(out)
        where = outdir.shown(out, CACHE_JSON)
        old = records.model(CacheSpec, existing.get("spec"), where, "a cache.json's spec", CACHE_JSON_REPAIR)
    except outdir.UnsafePath as exc:
        return OutState("damaged", str(exc))
    except records.DamagedRecord as exc:  # names the file, and what answers it
        return OutState("damaged", str(exc))
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        return OutState("damaged", " ".join(f"{out / CACHE_JSON} is unreadable: {exc}".split()))
    if old.fingerprint() != spec.fingerprint():
        diffs = {k: {"existing": a, "planned": b} for k, (a, b) in old.differences(spec).items()}
        return OutState(
            "incompatible",
            f"{out} holds a cache made with another spec (differs in: {', '.join(diffs)})",
            diffs,
            old.fingerprint(),
        )
    return OutState("compatible", f"{out} holds this cache: resuming", {}, old.fingerprint())
