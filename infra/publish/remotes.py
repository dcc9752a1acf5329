"""Open the store a Target names, by its kind (``s3``, ``hf``): a registry of factories. Each store's module
imports its client library only when it is used (boto3, huggingface_hub are optional extras)."""

from __future__ import annotations

from collections.abc import Callable

from infra.config import UploadConfig
from infra.publish.base import LocalFile, Remote, Target
from infra.publish.hub import layout_warnings as hub_warnings
from infra.publish.hub import make_hub_remote
from infra.publish.s3 import make_s3_remote
from infra.registry import Registry

RemoteFactory = Callable[[Target, UploadConfig], Remote]
REMOTES: Registry[RemoteFactory] = Registry("remote kind")


@REMOTES.register("s3")
def _s3(target: Target, config: UploadConfig) -> Remote:
    return make_s3_remote(target, config)


@REMOTES.register("hf")
def _hub(target: Target, config: UploadConfig) -> Remote:
    return make_hub_remote(target, config)


def open_remote(target: Target, config: UploadConfig) -> Remote:
    """An S3Remote or a HubRemote for `target`; PublishError when its client library is missing."""
    return REMOTES.get(target.kind)(target, config)


def layout_warnings(target: Target, files: list[LocalFile]) -> list[str]:
    """Where the store has layout guidance (the Hub: files per folder and per repo), what this layout breaks."""
    if target.kind != "hf":
        return []
    return hub_warnings(files)
