"""The S3 client of the publish step: the usual AWS chain (``AWS_ENDPOINT_URL`` honoured by botocore) or a
prefect-aws ``AwsCredentials`` block named in the config; and the transfer sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infra.config import UploadConfig
from infra.publish.base import PublishError

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig

MIB = 1024 * 1024


def transfer_config(config: UploadConfig) -> TransferConfig:
    """Multipart threshold and part size (`chunk_mb`), concurrency (`workers`)."""
    from boto3.s3.transfer import TransferConfig  # noqa: PLC0415 - optional dependency

    chunk = config.chunk_mb * MIB
    return TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=config.workers)


def make_client(config: UploadConfig) -> Any:
    """An S3 client from the default chain or the named AwsCredentials block. The pool holds a connection
    for each file thread and each part thread; retries use the standard mode."""
    import boto3  # noqa: PLC0415 - optional dependency
    from botocore.config import Config  # noqa: PLC0415

    client_config = Config(max_pool_connections=2 * config.workers + 2, retries={"mode": "standard"})
    if config.aws_credentials_block is None:
        return boto3.session.Session().client("s3", config=client_config)
    return block_client(config.aws_credentials_block, client_config)


def block_client(name: str, client_config: Any) -> Any:
    try:
        from prefect_aws import AwsCredentials  # noqa: PLC0415 - optional, only with a named block
    except ImportError as exc:
        raise PublishError(
            f"upload.aws_credentials_block={name!r} needs the prefect-aws package: pip install prefect-aws"
        ) from exc
    try:
        block = AwsCredentials.load(name)
    except ValueError as exc:
        raise PublishError(f"no AwsCredentials block named {name!r}: {exc}") from exc
    # The block's own client parameters (endpoint_url, verify, ...) apply; its botocore config, if any, is
    # merged under ours.
    params = dict(block.aws_client_parameters.get_params_override())
    if (own := params.pop("config", None)) is not None:
        client_config = own.merge(client_config)
    return block.get_boto3_session().client("s3", config=client_config, **params)
