"""What one shard task did: the typed result the flow adds up (its own module, so the chunk planner and the shard
loop both use it without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ShardResult:
    """What one shard task did."""

    shard: str
    device: str | None = None  # where its samples were encoded (``cuda:N`` on a host of several GPUs)
    counts: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    encoded: int = 0  # samples decoded and encoded by this run
    reused: int = 0  # done samples kept from an earlier run
    encode_errors: int = 0
    stale_kept: int = 0  # done samples whose source changed, kept by a `keep` decision
    stale_undecided: int = 0  # changed after the stale gate looked: kept as they were, the next run asks
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    interrupted: str | None = None  # the signal that stopped the shard between samples (SIGTERM, SIGINT, ...)
    text_calls: int = 0  # text-encoder calls (one per batch of prompts)
    prompts_encoded: int = 0  # prompts through the text encoder (each distinct prompt once per shard task)
    vae_calls: int = 0  # VAE calls (one per batch of clips)
    vae_clips: int = 0  # clips through the VAE (their own, not the copies filling a batch)
    store_retries: dict[str, int] = field(default_factory=dict)  # a store's transient errors retried, by kind
