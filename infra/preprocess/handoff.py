"""The one-sample sanity's encoded sample, handed to the preprocess so the same sample is not encoded twice.

The sanity (`infra.preprocess.sanity.run_sanity`) encodes the plan's first usable sample with the build's own
`encode.encode_sample`, writes it beside OUT, reads it back and checks it. A build keeps that result here (one
slot per OUT, this process only: two builds in one process, which the writer lock keeps on different OUTs, never
see or clear each other's). When the shard loop reaches the same sample it takes it instead of decoding and encoding
again, but only when nothing the tensors depend on can differ:

* the same plan fingerprint (spec, model identity, recipe) and the same sample key;
* the same source listing of the sample's members (size, mtime) and the same sha256 of every byte read now as
  when the sanity read it (the preprocess reads the sample's bytes again to compare).

Anything else (another process such as a Ray worker, a changed byte, a stale slot) encodes as before. The encode is
deterministic for the same bytes and spec (`tests/test_fidelity.py`), so the bytes written are the same either way.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from infra.errors import InputError
from infra.formats import EncodedSample
from infra.plan import BuildPlan
from infra.preprocess.encode import read_sample
from infra.sources import SampleRef
from infra.sources.identity import SourceIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Kept:
    fingerprint: str
    key: str
    identity: SourceIdentity
    sample: EncodedSample
    tokens: dict[str, Any]


_lock = threading.Lock()
_slots: dict[str, _Kept] = {}


def keep(plan: BuildPlan, ref: SampleRef, sample: EncodedSample, tokens: dict[str, Any]) -> None:
    """Hold the sanity's encoded `sample` of `ref` (read, so its identity has the sha256 of its bytes)."""
    if not ref.identity.read_sha256:
        return  # nothing to compare the preprocess's bytes with: it encodes the sample itself
    with _lock:
        _slots[str(plan.out)] = _Kept(
            plan.fingerprint, ref.key, ref.identity.model_copy(deep=True), sample, dict(tokens)
        )


def clear(plan: BuildPlan) -> None:
    """Drop the sample held for the plan's OUT (its preprocess has ended, or its run starts again)."""
    with _lock:
        _slots.pop(str(plan.out), None)


def held(plan: BuildPlan) -> _Kept | None:
    """What is held for the plan's OUT, if anything."""
    return _slots.get(str(plan.out))


def holds(plan: BuildPlan, ref: SampleRef) -> bool:
    """Whether a held sample may stand for `ref` (same OUT, fingerprint, key and listing; its bytes not yet
    compared): the shard's read-ahead leaves such a sample to `take` instead of decoding it."""
    kept = held(plan)
    return (
        kept is not None
        and kept.fingerprint == plan.fingerprint
        and kept.key == ref.key
        and kept.identity.members == ref.identity.members
    )


def take(ref: SampleRef, plan: BuildPlan) -> tuple[EncodedSample, dict[str, Any]] | None:
    """The held (sample, token info) for `ref` when its bytes, read now, are those the sanity encoded; the slot is
    emptied either way. None when nothing is held for it (the caller encodes it)."""
    if not holds(plan, ref):
        return None
    with _lock:
        kept = _slots.pop(str(plan.out), None)
    if kept is None:
        return None
    try:
        prompt, _ = read_sample(ref)  # fills ref.identity.read_sha256 with the bytes as they are now
    except InputError:
        return None  # encoded anew: its error is the one it gets
    if ref.identity.read_sha256 != kept.identity.read_sha256 or prompt != kept.sample.prompt:
        logger.info("%s changed since the sanity encoded it: encoded again", ref.key)
        return None
    return kept.sample, kept.tokens
