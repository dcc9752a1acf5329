"""What a sample was made from: its source members (name → size, mtime, and a content hash where the listing
has one, e.g. a caption held in a metadata file), and the sha256 of the bytes read when it was encoded.

A Source fills `members` from what it lists anyway (tar headers, a directory's stat), so resume can tell a
changed sample without reading it; `read_sha256` is filled as the bytes are read. Both go into the sample's
ledger row.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MemberIdentity(BaseModel):
    """One member of a sample as listed: size and mtime (and its content hash when the listing has it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int
    mtime: float
    sha256: str | None = None


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
            elif old.mtime != new.mtime:
                changed[name] = "mtime"
        return changed
