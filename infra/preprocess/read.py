"""Read, the trip's first stage: a `SampleRef` → its bytes (prompt, media), after the layout checks.

Runs on the shard loop's thread (a source's reader is not shared across threads: a tar is one file position).
Reading adds the sha256 of every byte read to ``ref.identity.read_sha256``: the sample's source identity, which its
ledger row records.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.errors import InputError
from infra.media.prompts import decode_prompt
from infra.sources import SampleRef


@dataclass(frozen=True)
class RawSample:
    """A sample's prompt and media bytes, as read from its source."""

    ref: SampleRef
    prompt: str
    media: bytes


def read(ref: SampleRef) -> RawSample:
    """The sample's prompt and video bytes; InputError for what cannot be encoded (a layout error, a duplicate id,
    no video)."""
    if "layout_error" in ref.extra:
        raise InputError("bad_layout", ref.extra["layout_error"])
    if "duplicate_of" in ref.extra:
        raise InputError(
            "duplicate_id", f"{ref.group}/{ref.id} is also {ref.extra['duplicate_of']}, met first: that one is encoded"
        )
    prompt = decode_prompt(ref.read_prompt())
    media = ref.read_media()
    if media is None:
        raise InputError("missing_video", "the sample has no video file")
    return RawSample(ref, prompt, media)
