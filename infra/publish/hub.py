"""The Hugging Face Hub store of the publish step: list with content hashes, read, and batched commits that
each are a resume point and each fail, rather than overwrite, when the branch moved since it was listed.

Upload path: explicit `HfApi.create_commit` batches of at most `upload.commit_every` files. In huggingface_hub
2.x `upload_large_folder` is gone, and `upload_folder` makes one commit for the whole folder unless the xet
transport is used (then it commits in several, at points of its own choosing); with xet disabled (as against a
loopback fake, `HF_HUB_DISABLE_XET=1`) it is the legacy single commit, so nothing lands until everything did.
Batching ourselves gives the same resume points on both transports: a killed upload keeps every batch that was
committed, and the rerun (the core lists first and sends only what is missing) sends none of it again. Each
commit carries `parent_commit` = the head this upload last saw (the listed commit, then each commit's own oid),
so a concurrent change on the branch fails the commit (412) and becomes RemoteConflict instead of a clobber.
The client picks the transport: xet whenever `hf_xet` is installed (production), LFS otherwise.
**Only the LFS transport is exercised by the tests (against tests/fakehub.py); the xet transport is verified
only against the real Hub, never here.**

Listing: the branch head first (`repo_info`), then `list_repo_tree(recursive=True)` *at that commit*, so the
listing and the `parent_commit` of the first commit describe the same state. LFS entries carry their sha256
without `expand=True` (the Hub pages 1000 entries without it, 50 with it), so we do not expand. A file stored
through LFS/xet gives its sha256; a regular (small text) file its git blob sha1.

Token: huggingface_hub's own lookup (HF_TOKEN, then the stored login), or a Prefect Secret block when
`upload.hub_token_block` names one. It is handed to HfApi and never logged, raised or shown in a repr.
The endpoint is HF_ENDPOINT read at call time (huggingface_hub reads it once, at import).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.config import UploadConfig
from infra.publish.base import LocalFile, OnSent, PublishError, Remote, RemoteConflict, RemoteFile, Target

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

REPO_TYPE = "dataset"
#: The Hub's repository guidance (https://huggingface.co/docs/hub/repositories-recommendations, 2025):
#: < 100k files per repo, < 10k entries per folder, files < 20 GB (50 GB is the hard limit), < 100 files per
#: commit (our batches are `upload.commit_every`; the Hub's own large-folder uploader commits up to 1000).
MAX_FILES_PER_REPO = 100_000
MAX_ENTRIES_PER_FOLDER = 10_000
MAX_FILE_BYTES = 20 * 10**9
HARD_FILE_BYTES = 50 * 10**9
SHARD_FIX = "use --format webdataset or parquet (shard formats) for caches this large"
#: Hub housekeeping at the repo root (made by the repo's initial commit), never a file of the cache.
HUB_FILES = frozenset({".gitattributes"})
_CONFLICT_STATUS = frozenset({409, 412})


def make_hub_remote(target: Target, config: UploadConfig) -> HubRemote:
    """A HubRemote for `target`; a PublishError naming the extra when huggingface_hub is not installed."""
    try:
        import huggingface_hub  # noqa: F401, PLC0415 - optional dependency, the `hub` extra
    except ImportError as exc:
        raise PublishError(f"uploading to {target.url} needs huggingface_hub: pip install latentforge[hub]") from exc
    return HubRemote(target, config)


def _token(config: UploadConfig) -> str | None:
    """The Prefect Secret block's value when one is named; None lets huggingface_hub look (HF_TOKEN, login)."""
    if not config.hub_token_block:
        return None
    from prefect.blocks.system import Secret  # noqa: PLC0415 - only when a block is named

    try:
        value = Secret.load(config.hub_token_block).get()
    except (ValueError, OSError) as exc:  # no such block, or no API to load it from; the message names the block
        raise PublishError(f"cannot load the Hub token from Secret block {config.hub_token_block!r}: {exc}") from exc
    if not isinstance(value, str) or not value:
        raise PublishError(f"Secret block {config.hub_token_block!r} does not hold a token string")
    return value


def _make_api(config: UploadConfig) -> HfApi:
    from huggingface_hub import HfApi  # noqa: PLC0415 - optional dependency

    try:
        version = metadata.version("latentforge")
    except metadata.PackageNotFoundError:
        version = "unknown"
    endpoint = os.environ.get("HF_ENDPOINT") or None  # None: huggingface_hub's constant
    return HfApi(endpoint=endpoint, token=_token(config), library_name="latentforge", library_version=version)


class HubRemote(Remote):
    """`Remote` on a Hub dataset repo, at `target.revision`, under `target.prefix`."""

    def __init__(self, target: Target, config: UploadConfig, *, api: HfApi | None = None) -> None:
        if target.kind != "hf":
            raise ValueError(f"HubRemote needs an hf:// target, got {target.url!r}")
        self.target = target
        self._commit_every = config.commit_every
        self._workers = config.workers
        self._private = config.private
        self._api = api if api is not None else _make_api(config)
        self._head: str | None = None  # the commit the last listing was taken at (None: no repo/branch yet)
        self._listed: dict[str, RemoteFile] | None = None
        log.info("Hub target %s (endpoint %s)", target.url, self._api.endpoint)

    def __repr__(self) -> str:
        return f"HubRemote({self.target.url!r})"

    def list(self) -> dict[str, RemoteFile]:
        """Every file under the target at the branch head ({} when the repo or branch does not exist yet)."""
        head = self._head_commit()
        files = self._tree(head) if head is not None else {}
        self._head, self._listed = head, files
        log.info("%s: %d file(s) listed at %s", self.target.url, len(files), head or "(no repo or branch yet)")
        return dict(files)

    def read(self, path: str) -> bytes | None:
        from huggingface_hub.errors import (  # noqa: PLC0415 - optional: the `hub` extra
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        key = self.target.key(path)
        with tempfile.TemporaryDirectory(prefix="latentforge-hub-") as tmp, self._errors(f"reading {key}"):
            try:
                local = self._api.hf_hub_download(
                    self.target.repo_id, key, repo_type=REPO_TYPE, revision=self.target.revision, local_dir=tmp
                )
            except (RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
                return None
            return Path(local).read_bytes()

    def send(self, files: Sequence[LocalFile], *, replace: Mapping[str, RemoteFile], on_sent: OnSent) -> None:
        """Commit `files` in batches of `commit_every`, each conditional on the head this upload last saw."""
        if not files:
            return
        if self._listed is None:
            self.list()
        if self._head is None:
            self._create()
        self._check_unchanged(files, replace)
        batches = [files[i : i + self._commit_every] for i in range(0, len(files), self._commit_every)]
        for number, batch in enumerate(batches, 1):
            self._commit(batch, f"{number}/{len(batches)}")
            for file in batch:
                on_sent(file)

    # -- internals -------------------------------------------------------------------------------------------
    def _head_commit(self) -> str | None:
        from huggingface_hub.errors import (  # noqa: PLC0415 - optional: the `hub` extra
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        with self._errors("reading the branch head"):
            try:
                info = self._api.repo_info(self.target.repo_id, repo_type=REPO_TYPE, revision=self.target.revision)
            except (RepositoryNotFoundError, RevisionNotFoundError):
                return None
        return info.sha

    def _tree(self, head: str) -> dict[str, RemoteFile]:
        from huggingface_hub import RepoFile  # noqa: PLC0415 - optional: the `hub` extra
        from huggingface_hub.errors import RemoteEntryNotFoundError  # noqa: PLC0415

        found: dict[str, RemoteFile] = {}
        with self._errors("listing"):
            try:
                for entry in self._api.list_repo_tree(
                    self.target.repo_id,
                    path_in_repo=self.target.prefix or None,
                    recursive=True,
                    repo_type=REPO_TYPE,
                    revision=head,
                ):
                    rel = self.target.relative(entry.path) if isinstance(entry, RepoFile) else None
                    if rel is None or (not self.target.prefix and rel in HUB_FILES):
                        continue
                    found[rel] = _remote_file(rel, entry)
            except RemoteEntryNotFoundError:  # the prefix folder does not exist yet
                return {}
        return found

    def _create(self) -> None:
        """Create the repo (and branch) this upload goes to, then list it: whatever is there now is the baseline."""
        with self._errors("creating the dataset repo"):
            self._api.create_repo(self.target.repo_id, repo_type=REPO_TYPE, private=self._private, exist_ok=True)
            if self.target.revision != "main":
                self._api.create_branch(
                    self.target.repo_id, branch=self.target.revision, repo_type=REPO_TYPE, exist_ok=True
                )
        self.list()
        if self._head is None:
            raise PublishError(f"{self.target.url}: created the repo but cannot read its branch head")

    def _check_unchanged(self, files: Sequence[LocalFile], replace: Mapping[str, RemoteFile]) -> None:
        """What the caller decided on must still be what this upload listed: a new path is absent, a replaced
        path holds the version the caller was shown. The commits then pin that listing with parent_commit."""
        listed = self._listed or {}
        for file in files:
            now, shown = listed.get(file.path), replace.get(file.path)
            if now is None and shown is not None:
                raise RemoteConflict(f"{self._where(file.path)} was removed from the remote after it was listed")
            if now is not None and shown is None:
                raise RemoteConflict(
                    f"{self._where(file.path)} exists on the remote and was not approved for replacement"
                )
            if now is not None and shown is not None and _version(now) != _version(shown):
                raise RemoteConflict(f"{self._where(file.path)} changed on the remote after it was listed")

    def _commit(self, batch: Sequence[LocalFile], label: str) -> None:
        from huggingface_hub import CommitOperationAdd  # noqa: PLC0415 - optional: the `hub` extra

        with contextlib.ExitStack() as opened:
            # every file of the batch open through the door (LocalFile.open) until the commit lands: the client
            # reads those descriptors, never a path again (a link swapped in meanwhile is not followed)
            operations = [
                CommitOperationAdd(
                    path_in_repo=self.target.key(f.path),
                    path_or_fileobj=f.data if f.data is not None else opened.enter_context(f.open()),
                )
                for f in batch
            ]
            self._commit_operations(batch, operations, label)

    def _commit_operations(self, batch: Sequence[LocalFile], operations: list[Any], label: str) -> None:
        for op, file in zip(operations, batch, strict=True):
            if op.upload_info.size != file.size:
                raise PublishError(f"{file.path}: {op.upload_info.size} bytes on disk, {file.size} when it was hashed")
        sent = {f.path: _sent_sha256(op, f) for op, f in zip(operations, batch, strict=True)}
        changed = [f.path for f in batch if sent[f.path] != f.sha256]
        if changed:  # the client hashed other bytes than the ledger's (bit rot, a later edit): send none of them
            raise PublishError(f"{len(changed)} file(s) changed on disk since they were recorded: {', '.join(changed)}")
        roles = ", ".join(f"{n} {role}" for role, n in sorted(Counter(f.role for f in batch).items()))
        with self._errors(f"commit {label}", conflict=True):
            info = self._api.create_commit(
                self.target.repo_id,
                operations,
                commit_message=f"latentforge upload {label}: {roles}",
                repo_type=REPO_TYPE,
                revision=self.target.revision,
                parent_commit=self._head,
                num_threads=self._workers,
            )
        self._head = info.oid
        listed = self._listed if self._listed is not None else {}
        listed.update({f.path: RemoteFile(f.path, f.size, sha256=sent[f.path]) for f in batch})
        self._listed = listed
        log.info("%s: commit %s landed (%d file(s), %s): %s", self.target.url, label, len(batch), roles, info.oid)

    def _where(self, path: str) -> str:
        return f"hf://datasets/{self.target.repo_id}@{self.target.revision}/{self.target.key(path)}"

    @contextmanager
    def _errors(self, doing: str, *, conflict: bool = False) -> Iterator[None]:
        """huggingface_hub and transport errors as PublishError (412/409 on a commit: RemoteConflict)."""
        from huggingface_hub.errors import HfHubHTTPError, HTTPError  # noqa: PLC0415 - optional: the `hub` extra

        try:
            yield
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            message = f"{self.target.url}: {doing} failed: {_one_line(exc)}"
            if conflict and status in _CONFLICT_STATUS:
                raise RemoteConflict(f"{message} (the branch moved since it was listed: list again)") from exc
            raise PublishError(message) from exc
        except (HTTPError, OSError, ValueError) as exc:
            raise PublishError(f"{self.target.url}: {doing} failed: {type(exc).__name__}: {_one_line(exc)}") from exc


def _remote_file(rel: str, entry: object) -> RemoteFile:
    """An LFS/xet file proves its content by sha256; a regular file by its git blob sha1. A file with a xet hash
    and no LFS pointer gives neither (never the pointer's sha1 as a content hash): same_content says None; its xet
    hash is kept as its version (`etag`), so that a replace token covers it as it does every other remote file."""
    lfs, xet = getattr(entry, "lfs", None), getattr(entry, "xet_hash", None)
    size = int(getattr(entry, "size", 0))
    if lfs is not None:
        return RemoteFile(rel, size, sha256=lfs.sha256)
    if xet is not None:  # its hash is still the version a replace approval names (`diff.replace_token`)
        return RemoteFile(rel, size, etag=f"xet:{xet}")
    return RemoteFile(rel, size, git_sha1=getattr(entry, "blob_id", None))


def _sent_sha256(op: Any, file: LocalFile) -> str:
    """The sha256 of the bytes the client will send, hashed now (before the commit). The client keeps it, so
    LFS does not hash again; xet, which would hash while uploading, reads the file once more."""
    return op.upload_info.sha256.hex()


def _version(file: RemoteFile) -> tuple[int, str | None, str | None]:
    return file.size, file.sha256, file.git_sha1


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """The error (the Hub's message included) on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def layout_warnings(files: list[LocalFile]) -> list[str]:
    """Where this layout breaks the Hub's repository guidance: files per repo, entries per folder, file size."""
    warnings: list[str] = []
    if len(files) > MAX_FILES_PER_REPO:
        warnings.append(
            f"{len(files):,} files: the Hub recommends fewer than {MAX_FILES_PER_REPO:,} per repo; {SHARD_FIX}"
        )
    entries: dict[str, set[str]] = {}
    for file in files:
        path = file.path
        while path:
            parent = posixpath.dirname(path)
            entries.setdefault(parent, set()).add(path)
            path = parent
    for folder, names in sorted(entries.items()):
        if len(names) > MAX_ENTRIES_PER_FOLDER:
            where = f"{folder}/" if folder else "the repo root"
            warnings.append(
                f"{where} holds {len(names):,} entries: the Hub recommends fewer than {MAX_ENTRIES_PER_FOLDER:,} "
                f"per folder; {SHARD_FIX}"
            )
    for file in sorted(files, key=lambda f: f.path):
        if file.size > MAX_FILE_BYTES:
            limit = (
                "over the Hub's hard limit of 50 GB" if file.size > HARD_FILE_BYTES else "over the recommended 20 GB"
            )
            warnings.append(f"{file.path} is {file.size / 1e9:.1f} GB, {limit}: split it into smaller shards")
    return warnings
