"""Our manifest against the remote listing: what to send, what is already there, what may be updated in
place, and what conflicts (a different remote file at one of our paths, which only an approval replaces)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from infra import records
from infra.cache.cachedir import CACHE_JSON
from infra.publish.base import UPDATABLE_ROLES, LocalFile, Remote, RemoteFile, Target, same_content
from infra.publish.card import generated_card
from infra.publish.manifest import Manifest

logger = logging.getLogger(__name__)

#: Remote files outside the manifest that are not a problem: reports of older runs and uploads.
TOLERATED_EXTRA = ("reports/",)


@dataclass
class UploadPlan:
    """The decision per file. `conflicts` are (ours, theirs) pairs that nothing replaces without approval."""

    target: Target
    fingerprint: str
    remote_fingerprint: str | None
    send: list[LocalFile] = field(default_factory=list)
    unchanged: list[LocalFile] = field(default_factory=list)
    update: list[tuple[LocalFile, RemoteFile]] = field(default_factory=list)
    conflicts: list[tuple[LocalFile, RemoteFile]] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    #: The remote listing this plan was made from (the remote check reuses it when nothing was sent).
    listing: dict[str, RemoteFile] = field(default_factory=dict)

    @property
    def token(self) -> str:
        """The approval token for exactly these conflicts at this target (see `replace_token`)."""
        return replace_token(self.target, self.conflicts)

    @property
    def bytes_to_send(self) -> int:
        return sum(f.size for f in self.send) + sum(f.size for f, _ in self.update + self.conflicts)

    def conflicts_markdown(self, limit: int = 30) -> str:
        """The preview a person approves from: every conflicting path with both versions."""
        lines = [
            f"## Remote conflict at `{self.target.url}`",
            "",
            f"{len(self.conflicts)} remote file(s) differ from this cache's and would be replaced. "
            f"Remote cache fingerprint: `{(self.remote_fingerprint or 'none')[:16]}`, "
            f"ours: `{self.fingerprint[:16]}`.",
            "",
            "| path | remote bytes | remote sha256 | our bytes | our sha256 |",
            "|---|---|---|---|---|",
        ]
        for ours, theirs in self.conflicts[:limit]:
            remote_hash = (theirs.sha256 or theirs.git_sha1 or "unknown")[:12]
            lines.append(f"| `{ours.path}` | {theirs.size} | {remote_hash} | {ours.size} | {ours.sha256[:12]} |")
        if len(self.conflicts) > limit:
            lines.append(f"| … {len(self.conflicts) - limit} more | | | | |")
        lines += [
            "",
            "### Choices",
            "* **replace** — replace exactly these remote files (a file changed since this listing is not replaced)",
            f"* **abort** — send nothing more; also what a timeout means. Unattended: `--approve-replace {self.token}`",
        ]
        return "\n".join(lines) + "\n"


def replace_token(target: Target, conflicts: list[tuple[LocalFile, RemoteFile]]) -> str:
    """A short token bound to the target and to each conflicting path's remote and local version: what the remote
    held at each path it replaces when it was printed (an S3 ETag, a Hub file's sha256, git blob id or xet hash); a
    remote file changed since gives another token, and `send` replaces only the version listed."""
    parts = [target.url]
    for ours, theirs in sorted(conflicts, key=lambda pair: pair[0].path):
        remote_id = theirs.etag or theirs.sha256 or theirs.git_sha1 or str(theirs.size)
        parts.append(f"{ours.path}\0{remote_id}\0{ours.sha256}")
    return hashlib.sha256("\0\0".join(parts).encode()).hexdigest()[:20]


def remote_fingerprint(remote: Remote) -> str | None:
    """The fingerprint in the remote cache.json, None when there is none or it is unreadable."""
    data = remote.read(CACHE_JSON)
    if data is None:
        return None
    where = remote.target.key(CACHE_JSON)
    try:
        value = records.loads(data, where, "a cache.json", "treated as holding no cache").get("fingerprint")
    except records.DamagedRecord as exc:  # one line: what it is and how it is taken
        logger.warning("%s", exc)
        return None
    except AttributeError:
        logger.warning("%s: not a cache.json (not a JSON object); treated as holding no cache", where)
        return None
    return str(value) if value else None


def plan_upload(
    manifest: Manifest,
    listing: dict[str, RemoteFile],
    remote_fp: str | None,
    target: Target,
    read: Callable[[str], bytes | None] | None = None,
) -> UploadPlan:
    """Decide per file. Updating in place is allowed only for updatable roles (card, ledgers) on a remote that
    holds this same cache (same fingerprint), and for the card only when the remote one is a card latentforge wrote
    that nobody edited (`read`: the remote's reader; without one, never); everything else that differs is a
    conflict, which only an approval replaces."""
    plan = UploadPlan(target, manifest.fingerprint, remote_fp, listing=listing)
    same_cache = remote_fp == manifest.fingerprint
    for ours in manifest.files:
        theirs = listing.get(ours.path)
        if theirs is None:
            plan.send.append(ours)
            continue
        verdict = same_content(ours, theirs)
        if verdict:
            plan.unchanged.append(ours)
        elif ours.role in UPDATABLE_ROLES and same_cache and verdict is False and _written_by_us(ours, read):
            plan.update.append((ours, theirs))
        else:
            plan.conflicts.append((ours, theirs))
    plan.extra = foreign(manifest, listing)
    return plan


def _written_by_us(ours: LocalFile, read: Callable[[str], bytes | None] | None) -> bool:
    """Whether the remote file at `ours.path` may be updated in place: a ledger of this same cache is ours; a README
    is the card only when it still is exactly one latentforge generated (a person's own README, or an edit to ours,
    is theirs)."""
    if ours.role != "card":
        return True
    data = read(ours.path) if read is not None else None
    return data is not None and generated_card(data)


def foreign(manifest: Manifest, listing: dict[str, RemoteFile]) -> list[str]:
    """Remote paths that are not part of this cache (older reports excepted), sorted."""
    return sorted(p for p in listing if p not in manifest.all_paths and not p.startswith(TOLERATED_EXTRA))
