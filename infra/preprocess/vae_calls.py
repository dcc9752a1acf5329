"""Video batching (``--video-batch N``): the current sample's pixels encoded in one VAE call with up to N - 1 of the
samples the shard's prefetcher has already prepared, those of the same shape only (one bucket, one geometry:
`infra.preprocess.shape_batches`).

Each sample still goes through the shard loop, its ledger row and its write one at a time, as without batching:
the latents of the others wait in the shard's batches (`ShapeBatches.hold`) until their turn, and a stop or a
kill drops them with the rest of what was prepared ahead. A batch that fails is encoded again one sample at a
time, so a failing sample gets its own error and its own failed row, and the others their latents.

Batched and batch-one latents agree within the compute dtype's tolerance, not bit for bit (CPU, tiny Wan2.2, at
17×128²: stored bf16 differs by at most one unit in the last place in <1% of the values; bench/README.md "Memory
options"). What does hold bit for bit is one sample's result at one batch size, whatever it is batched with: so
every VAE call is made at the spec's batch size (`CacheSpec.video_batch`), a short batch filled up with copies of
its last sample, and the batch size is part of the fingerprint. With ``--vae-slicing`` the VAE encodes a batch
one sample at a time: the spec's batch is then 1 and nothing is padded.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from infra.job import Job
from infra.models import LoadedFamily
from infra.preprocess.prepare import PreparedSample
from infra.preprocess.shape_batches import ShapeBatches

logger = logging.getLogger("infra.preprocess.videos")  # its name before the rename: the same log lines

Result = torch.Tensor | Exception


@dataclass
class VideoStats:
    """VAE work of one shard task: calls, clips encoded (their own), clips padded in (copies filling a batch)."""

    calls: int = 0
    clips: int = 0
    padded: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, clips: int, padded: int) -> None:
        with self.lock:
            self.calls += 1
            self.clips += clips
            self.padded += padded


def encode_group(
    encoder: LoadedFamily, pixels: list[torch.Tensor], fixed: int, stats: VideoStats | None = None
) -> list[Result]:
    """The latents of each clip (all of one shape), or the error it raised: one VAE call at batch size `fixed`
    (a short group filled up with copies of its last clip; 1: no filling); if that call fails, each clip again
    on its own (padded to `fixed` with copies of itself), so an error belongs to the clip that raised it. Each VAE
    call is counted in `stats`."""
    stats = stats if stats is not None else VideoStats()
    try:
        return list(_call(encoder, pixels, fixed, stats))
    except Exception as exc:  # noqa: BLE001 - the group is split and each clip's own error kept
        if len(pixels) == 1:
            return [exc]
        logger.warning("a batch of %d clips failed (%s): encoding them one at a time", len(pixels), exc)
    results: list[Result] = []
    for one in pixels:
        try:
            results.append(_call(encoder, [one], fixed, stats)[0])
        except Exception as exc:  # noqa: BLE001 - this clip's error, raised at its turn
            results.append(exc)
    return results


def _call(encoder: LoadedFamily, pixels: list[torch.Tensor], fixed: int, stats: VideoStats) -> list[torch.Tensor]:
    padded = pixels + [pixels[-1]] * (fixed - len(pixels)) if fixed > 1 else pixels
    stats.add(len(pixels), len(padded) - len(pixels))
    return encoder.encode_videos(padded)[: len(pixels)]


def latents(
    encoder: LoadedFamily, prepared: PreparedSample, job: Job, batches: ShapeBatches | None, stats: VideoStats
) -> torch.Tensor:
    """The sample's latents: held from a batch encoded at an earlier sample's turn, else encoded now together
    with up to ``--video-batch - 1`` samples of its shape prepared ahead (`batches`; their latents held for their
    turns)."""
    if batches is not None:
        held = batches.release(prepared.ref)
        if held is not None:
            if isinstance(held, Exception):
                raise held
            return held
    pixels = prepared.video.pixels
    gather = job.gather
    others = batches.ready(gather - 1, tuple(pixels.shape)) if batches is not None and gather > 1 else []
    results = encode_group(encoder, [pixels, *(other.video.pixels for other in others)], job.spec.video_batch, stats)
    for other, result in zip(others, results[1:], strict=True):
        batches.hold(other.ref, result)  # type: ignore[union-attr] - others is empty without batches
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]
