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
from infra.sources.base import BAD_ROW, OUTSIDE_SOURCE
from infra.sources.names import sample_name


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
    if BAD_ROW in ref.extra:  # a metadata row that cannot be a sample: nothing of it is read
        raise InputError(BAD_ROW, ref.extra[BAD_ROW])
    if "layout_error" in ref.extra:
        raise InputError("bad_layout", ref.extra["layout_error"])
    if OUTSIDE_SOURCE in ref.extra:  # a link out of the source's root: not read
        raise InputError(OUTSIDE_SOURCE, ref.extra[OUTSIDE_SOURCE])
    if "duplicate_of" in ref.extra:
        raise InputError(
            "duplicate_id",
            f"{sample_name(ref.group, ref.id)} is also {ref.extra['duplicate_of']}, met first: that one is encoded",
        )
    if "name_collision" in ref.extra:
        raise InputError("name_collision", ref.extra["name_collision"])
    if "superseded_by" in ref.extra:
        raise InputError("superseded", ref.extra["superseded_by"])
    prompt = caption_prompt(ref.read_prompt(), captions or CaptionRules())
    media = ref.read_media()
    if media is None:
        raise InputError("missing_video", "the sample has no video file")
    roles = {}
    for role, reader in ref.read_roles.items():
        data = reader()
        if data is None:
            raise InputError(f"missing_{role}", f"the sample's {role} file is not listed or not there")
        roles[role] = data
    return RawSample(ref, prompt, media, roles)
