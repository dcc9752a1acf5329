"""Tasks of the upload step: list the remote and plan, send, verify the remote against the manifest."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.publish.base import OnSent, Remote, RemoteFile
from infra.publish.check import RemoteCheck, check_remote
from infra.publish.core import SendStats, send_plan
from infra.publish.diff import UploadPlan, plan_upload, remote_fingerprint
from infra.publish.manifest import Manifest


@task(name="plan-upload", cache_policy=NO_CACHE)
def list_and_plan(manifest: Manifest, remote: Remote) -> UploadPlan:
    """List the remote and decide per file: send, unchanged, update in place, conflict (the remote card is read
    to tell latentforge's own from a README a person wrote)."""
    return plan_upload(manifest, remote.list(), remote_fingerprint(remote), remote.target, remote.read)


@task(name="upload", cache_policy=NO_CACHE)
def send(plan: UploadPlan, remote: Remote, replace_conflicts: bool, progress: OnSent | None = None) -> SendStats:
    """Send the plan stage by stage (manifest last); `progress` is called with each file once it is stored."""
    return send_plan(plan, remote, replace_conflicts=replace_conflicts, on_sent=progress)


@task(name="verify-remote", cache_policy=NO_CACHE)
def verify_remote(manifest: Manifest, remote: Remote, listing: dict[str, RemoteFile] | None = None) -> RemoteCheck:
    """Compare the remote with the manifest (count, sizes, sha256): a fresh listing, or `listing` when the
    upload sent nothing since it was taken (an unchanged rerun lists once, not twice)."""
    return check_remote(manifest, listing if listing is not None else remote.list(), remote.target.url)
