"""What a dataset card says that depends on the store it is published to: its title, the root its layout is drawn
from, and the loading snippet a reader pastes to get one sample (the Hub: `hf_hub_download`; S3: boto3, the
store's own client, which the `s3` extra installs). A registry by target kind, so a new store adds one entry."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from infra.publish.base import Target

#: The lines after a sample's bytes are loaded: the same for every store.
_AFTER_LOAD = [
    'x0, text_embeds = sample["x0"], sample["text_embeds"]',
    'mask = torch.arange(text_embeds.shape[0]) < sample["seq_len"]  # the real prompt tokens',
]


@dataclass(frozen=True)
class CardStore:
    """A store's part of the card."""

    title: Callable[[Target], str]
    root: Callable[[Target], str]
    #: The python lines that load the sample at `key` (the store's full key) into `sample`.
    load: Callable[[Target, str], list[str]]


def _hub_title(target: Target) -> str:
    return target.repo_id.split("/")[-1] + (f"/{target.prefix}" if target.prefix else "")


def _hub_root(target: Target) -> str:
    return f"hf://datasets/{target.repo_id}" + (f"/{target.prefix}" if target.prefix else "")


def _hub_load(target: Target, key: str) -> list[str]:
    return [
        "import torch",
        "from huggingface_hub import hf_hub_download",
        "",
        f'path = hf_hub_download("{target.repo_id}", "{key}", repo_type="dataset", revision="{target.revision}")',
        'sample = torch.load(path, map_location="cpu", weights_only=True)  # plain tensors and strings, no code',
    ]


def _s3_root(target: Target) -> str:
    return f"s3://{target.bucket}" + (f"/{target.prefix}" if target.prefix else "")


def _s3_load(target: Target, key: str) -> list[str]:
    return [
        "import io",
        "",
        "import boto3",
        "import torch",
        "",
        "# credentials and endpoint: the AWS chain (AWS_PROFILE or keys; AWS_ENDPOINT_URL for an S3-compatible store)",
        f'body = boto3.client("s3").get_object(Bucket="{target.bucket}", Key="{key}")["Body"].read()',
        'sample = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)  # plain tensors, no code',
    ]


STORES: dict[str, CardStore] = {
    "hf": CardStore(title=_hub_title, root=_hub_root, load=_hub_load),
    "s3": CardStore(title=_s3_root, root=_s3_root, load=_s3_load),
}


def card_store(target: Target) -> CardStore:
    """The card's store-specific parts for `target` (its kind is one `parse_target` accepts)."""
    return STORES[target.kind]


def loading_code(target: Target, path: str) -> list[str]:
    """The snippet that loads the sample published at target-relative `path` and names its tensors."""
    key = posixpath.join(target.prefix, path) if target.prefix else path
    return [*card_store(target).load(target, key), *_AFTER_LOAD]
