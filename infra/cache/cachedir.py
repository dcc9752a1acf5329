"""The cache root: ``cache.json`` (spec + fingerprint + provenance) and what OUT holds now.

``cache.json`` is written once, before the first sample, and never rewritten: it declares what the
directory holds, so a crashed first run is still recognised as this cache on the rerun.
"""

from __future__ import annotations

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

from infra import outdir
from infra.cache.lock import LOCK_NAME
from infra.config import CacheSpec
from infra.outstore import StoreOut
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

CACHE_JSON = "cache.json"
OutKind = Literal["absent", "compatible", "incompatible", "foreign", "damaged"]


@dataclass
class OutState:
    """What OUT holds, compared with the planned spec."""

    kind: OutKind
    message: str
    differences: dict[str, Any] = field(default_factory=dict)
    existing_fingerprint: str | None = None


def read_cache_json(out: Path) -> dict[str, Any]:
    """The parsed cache.json (raises FileNotFoundError / ValueError)."""
    return json.loads(outdir.read_text(out, CACHE_JSON))


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
    """Create cache.json (replaces an existing one only when told: an approved overwrite)."""
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
    return atomic_write(CACHE_JSON, text.encode(), replace=replace, out=out).path


def _visible_entries(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if p.name != LOCK_NAME]


def classify(out: Path, spec: CacheSpec) -> OutState:
    """absent / compatible / incompatible / foreign / damaged, with what differs."""
    out = outdir.root(out)
    if isinstance(out, StoreOut):  # a prefix: absent while no object is below it (but the lease)
        if not [e for e in outdir.entries(out) if e.name != LOCK_NAME]:
            return OutState("absent", f"{out} does not exist or is empty")
    elif not out.exists() or (out.is_dir() and not _visible_entries(out)):
        return OutState("absent", f"{out} does not exist or is empty")
    elif not out.is_dir():
        return OutState("foreign", f"{out} exists and is not a directory")
    try:
        if outdir.lstat(out, CACHE_JSON) is None:
            return OutState("foreign", f"{out} holds files but no {CACHE_JSON}: not written by latentforge")
        existing = read_cache_json(out)
        old = CacheSpec.model_validate(existing["spec"])
    except outdir.UnsafePath as exc:
        return OutState("damaged", str(exc))
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        return OutState("damaged", f"{out / CACHE_JSON} is unreadable: {exc}")
    if old.fingerprint() != spec.fingerprint():
        diffs = {k: {"existing": a, "planned": b} for k, (a, b) in old.differences(spec).items()}
        return OutState(
            "incompatible",
            f"{out} holds a cache made with another spec (differs in: {', '.join(diffs)})",
            diffs,
            old.fingerprint(),
        )
    return OutState("compatible", f"{out} holds this cache: resuming", {}, old.fingerprint())
