"""The checks of a BuildConfig that need more than `infra.config` (which imports nothing of the project but its
errors): run by every command before Prefect starts, and by the flows for a run started from a form or a
deployment.
"""

from __future__ import annotations

from infra.config import BuildConfig, UploadConfig
from infra.ops.runners import require_ray
from infra.publish.base import parse_target
from infra.recipes import apply_recipe


def resolve_config(config: BuildConfig) -> BuildConfig:
    """`config` with its recipe's settings filled in; ConfigError for an unknown recipe, an upload target that
    does not parse, or ``--runner ray`` without Ray installed (the runner checks that again where it starts)."""
    config = apply_recipe(config)
    if config.upload is not None:
        check_upload(config.upload)
    if config.run.runner == "ray":
        require_ray()
    return config


def check_upload(config: UploadConfig) -> UploadConfig:
    """`config`, once its target parses (hf://datasets/ORG/NAME[@revision][/path] or s3://BUCKET/PREFIX)."""
    parse_target(config.to)
    return config
