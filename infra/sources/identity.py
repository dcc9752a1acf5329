"""What a sample was made from: its source members (name → size, mtime, and a content hash where the listing
has one, e.g. a caption held in a metadata file), and the sha256 of the bytes read when it was encoded.

A Source fills `members` from what it lists anyway (tar headers, a directory's stat), so resume can tell a
changed sample without reading it; `read_sha256` is filled as the bytes are read. Both go into the sample's
ledger row.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class MemberIdentity(BaseModel):
    """One member of a sample as listed: size and mtime (and its content hash when the listing has it); an object
    in a store (`infra.sources.store`) by size and its store's version (mtime 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int
    mtime: float
    sha256: str | None = None
    #: The object's version as its store lists it (an ETag, a version id, a Hub blob id); None: a local file.
    version: str | None = None

    @model_serializer(mode="wrap")
    def _without_absent_version(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("version") is None:  # a local file's row keeps the bytes it had before stores were read
            data.pop("version", None)
        return data


class SourceIdentity(BaseModel):
    """A sample's members as listed, and the sha256 of each member's bytes as read when it was encoded."""

    model_config = ConfigDict(extra="forbid")

    members: dict[str, MemberIdentity] = Field(default_factory=dict)
    read_sha256: dict[str, str] = Field(default_factory=dict)

    def differs_in(self, current: SourceIdentity) -> dict[str, str]:
        """{member: what changed} between this (recorded) listing and `current`; {} when they agree."""
        changed: dict[str, str] = {}
        for name in sorted(self.members.keys() | current.members.keys()):
            old, new = self.members.get(name), current.members.get(name)
            if old is None or new is None:
                changed[name] = "added" if old is None else "removed"
            elif old.size != new.size:
                changed[name] = f"size {old.size} → {new.size}"
            elif old.sha256 is not None and new.sha256 is not None and old.sha256 != new.sha256:
                changed[name] = "content"
            elif old.version and new.version and old.version != new.version:
                changed[name] = "version"
            elif old.mtime != new.mtime:
                changed[name] = "mtime"
        return changed
