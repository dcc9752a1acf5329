"""``--text-offload``: a shard's (or chunk's) prompts encoded first, in batches, then the text encoder parked off
the device (`infra.models.memory`) while the VAE encodes the shard's videos; the embeddings wait in the shard's
text cache (`infra.preprocess.texts`), so bound it (``--text-cache-mb``, ``--chunk-size``) to what the prompts need.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator

from infra.job import Job
from infra.media.prompts import CaptionRules, caption_prompt
from infra.models import LoadedFamily, memory
from infra.models.base import TextSettings
from infra.preprocess.texts import TextCache
from infra.sources import SampleRef, ShardReadError

logger = logging.getLogger(__name__)


def shard_prompts(refs: Iterable[SampleRef], captions: CaptionRules | None = None) -> list[str]:
    """The distinct prompts of `refs` (their captions through `captions`), in order; a prompt that cannot be read
    is left to the sample's turn (its row gets the error it gets without this phase)."""
    prompts: dict[str, None] = {}
    for ref in refs:
        try:
            prompts.setdefault(caption_prompt(ref.read_prompt(), captions or CaptionRules()), None)
        except Exception as exc:  # noqa: BLE001 - reported at the sample's own turn
            logger.debug("prompt of %s not read ahead: %s", ref.key, exc)
    return list(prompts)


def text_first(job: Job, refs: Iterable[SampleRef], get_encoder: Callable[[], LoadedFamily], cache: TextCache) -> int:
    """Encode the prompts of `refs` not held yet in `cache`, ``--text-batch`` at a time, then park the text encoder;
    the number of prompts the cache could not keep (each brings the encoder back at its turn)."""
    if "text_embeddings" not in job.kinds:
        return 0
    prompts = shard_prompts(refs, CaptionRules.of(job.spec))
    if not prompts:
        return 0
    encoder, run, settings = get_encoder(), job.run, TextSettings.of(job.spec)
    with memory.text_in_use(encoder):
        for i, prompt in enumerate(prompts):
            upcoming = prompts[i + 1 : i + run.text_batch]
            cache.embedding(encoder, prompt, settings, upcoming=upcoming, batch=run.text_batch)
    lost = sum(not cache.holds(prompt, settings) for prompt in prompts)
    if lost:
        logger.warning(
            "--text-offload: %d of %d prompts did not fit --text-cache-mb %d; each brings the text encoder back",
            lost,
            len(prompts),
            run.text_cache_mb,
        )
    return lost


def text_first_of(
    job: Job,
    samples: Iterator[SampleRef],
    span: tuple[int, int | None],
    wanted: Callable[[SampleRef], bool],
    get_encoder: Callable[[], LoadedFamily],
    cache: TextCache,
) -> None:
    """`text_first` over a pass of its own of a shard's source `samples` (closed at the end): the refs of `span`
    (the shard's quota or a chunk) that are `wanted`, up to a read error (the main loop meets it again and records
    it)."""
    with contextlib.closing(samples):  # type: ignore[type-var] - the source's generator
        refs = itertools.islice(samples, *span)
        text_first(job, _until_error(r for r in refs if wanted(r)), get_encoder, cache)


def text_first_held(
    job: Job,
    refs: Iterator[SampleRef],
    count: int,
    wanted: Callable[[SampleRef], bool],
    get_encoder: Callable[[], LoadedFamily],
    cache: TextCache,
) -> Iterator[SampleRef] | None:
    """`text_first` over the first `count` of `refs` (the shard's span as planned: its quota, or a chunk) that are
    `wanted`, from the shard task's own listing: the refs for its loop, those read here first (held meanwhile; the
    listing is not run past them, so the shard stays open for their reads), then the rest of `refs`. None when the
    listing ended before `count` (the shard changed or was damaged since it was planned): the task then lists it
    again for the loop, its prompts in a pass of their own (`text_first_of`), as it did before it held them."""
    try:
        held = list(itertools.islice(refs, count))
    except ShardReadError as exc:
        logger.debug("prompt pass stopped: %s", exc)
        return None
    if len(held) < count:
        return None
    chosen = [ref for ref in held if wanted(ref)]
    noted = [dict(ref.identity.read_sha256) for ref in chosen]
    text_first(job, chosen, get_encoder, cache)
    for ref, before in zip(chosen, noted, strict=True):  # the sample's own turn notes its digests, in its order
        ref.identity.read_sha256.clear()
        ref.identity.read_sha256.update(before)
    return itertools.chain(held, refs)


def _until_error(refs: Iterator[SampleRef]) -> Iterator[SampleRef]:
    try:
        yield from refs
    except ShardReadError as exc:
        logger.debug("prompt pass stopped: %s", exc)
