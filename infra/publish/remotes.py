"""Open the store a Target names (imports the store's client library only when it is used)."""

from __future__ import annotations

from infra.config import UploadConfig
from infra.publish.base import LocalFile, Remote, Target


def open_remote(target: Target, config: UploadConfig) -> Remote:
    """An S3Remote or a HubRemote for `target`; PublishError when its client library is missing."""
    if target.kind == "s3":
        from infra.publish.s3 import make_s3_remote  # noqa: PLC0415 - boto3 is an optional extra

        return make_s3_remote(target, config)
    from infra.publish.hub import make_hub_remote  # noqa: PLC0415

    return make_hub_remote(target, config)


def layout_warnings(target: Target, files: list[LocalFile]) -> list[str]:
    """Where the store has layout guidance (the Hub: files per folder and per repo), what this layout breaks."""
    if target.kind != "hf":
        return []
    from infra.publish.hub import layout_warnings as hub_warnings  # noqa: PLC0415

    return hub_warnings(files)
