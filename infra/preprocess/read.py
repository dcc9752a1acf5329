"""Read, the trip's first stage: a `SampleRef` → its bytes (prompt, media), after the layout checks.

Runs on the shard loop's thread (a source's reader is not shared across threads: a tar is one file position).
Reading adds the sha256 of every byte read to ``ref.identity.read_sha256``: the sample's source identity, which its
ledger row records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infra.errors import InputError
from infra.media.prompts import CaptionRules, caption_prompt
from infra.sources import SampleRef


@dataclass(frozen=True)
class RawSample:
    """A sample's prompt and media bytes, as read from its source."""

    ref: SampleRef
    prompt: str
    media: bytes
    #: The bytes of the sample's other roles its mode reads (a reference video, a mask ...), by role.
    roles: dict[str, bytes] = field(default_factory=dict)


def read(ref: SampleRef, captions: CaptionRules | None = None) -> RawSample:
    """The sample's prompt (its caption through `captions`, the spec's caption handling: `CaptionRules.of`), video
    bytes and the bytes of its mode's other roles; InputError for what cannot be encoded (a layout error, a file
    that leads out of its source's root, a duplicate id, an output name another sample has, a row superseded by a
    later one, no video, a role's file not listed or not there: ``missing_<role>``)."""
    if (problem := ref.problem) is not None:  # found by the listing: nothing of the sample is read
        raise problem.error()
    if ref.read_together is not None:  # one request where the source has them side by side in a store
        text, media = ref.read_together()
    else:
        text, media = ref.read_prompt(), ref.read_media()
    prompt = caption_prompt(text, captions or CaptionRules())
    if media is None:
        raise InputError("missing_video", "the sample has no video file")
    roles = {}
    for role, reader in ref.read_roles.items():
        data = reader()
        if data is None:
            raise InputError(f"missing_{role}", f"the sample's {role} file is not listed or not there")
        roles[role] = data
    return RawSample(ref, prompt, media, roles)
