"""Remote verification: the remote listing against the manifest (count, sizes, sha256 where the store gives
it). Any missing, different or unprovable file, or a remote file that is not part of this cache, fails it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infra.publish.base import RemoteFile, same_content
from infra.publish.diff import foreign
from infra.publish.manifest import Manifest
from infra.report_files import Section, render_markdown, render_text


@dataclass
class RemoteCheck:
    """What the remote holds of the manifest."""

    target: str
    expected: int
    expected_bytes: int
    verified: int = 0
    missing: list[str] = field(default_factory=list)
    size_mismatch: list[str] = field(default_factory=list)
    hash_mismatch: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)  # same size, the store gives no hash to compare
    extra: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.size_mismatch or self.hash_mismatch or self.unverifiable or self.extra)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def _sections(self) -> list[Section]:
        return [
            (title, ["path"], [[p] for p in paths[:50]])
            for title, paths in (
                ("missing on the remote", self.missing),
                ("size differs", self.size_mismatch),
                ("sha256 differs", self.hash_mismatch),
                ("no hash to compare", self.unverifiable),
                ("on the remote, not part of this cache", self.extra),
            )
        ]

    def _intro(self) -> list[str]:
        verdict = "OK" if self.ok else "MISMATCH"
        return [f"{verdict}: {self.verified} of {self.expected} files verified ({self.expected_bytes} bytes)"]

    def markdown(self) -> str:
        return render_markdown(f"Remote verification: {self.target}", self._intro(), self._sections())

    def text(self) -> str:
        return render_text(f"remote verification: {self.target}", self._intro(), self._sections())


def check_remote(manifest: Manifest, listing: dict[str, RemoteFile], target_url: str) -> RemoteCheck:
    """Compare every manifest file with the listing; a store without hashes cannot pass (size is not proof)."""
    check = RemoteCheck(target_url, len(manifest.files), manifest.bytes)
    for ours in manifest.files:
        theirs = listing.get(ours.path)
        if theirs is None:
            check.missing.append(ours.path)
            continue
        verdict = same_content(ours, theirs)
        if verdict:
            check.verified += 1
        elif theirs.size != ours.size:
            check.size_mismatch.append(ours.path)
        elif verdict is False:
            check.hash_mismatch.append(ours.path)
        else:
            check.unverifiable.append(ours.path)
    check.extra = foreign(manifest, listing)
    return check
