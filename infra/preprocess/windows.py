"""``windows:K``: one clip, many samples. A clip's ref becomes one ref per window, ``<key>@<first frame>``.

On resume a clip whose windows are all in the ledger (each row says how many windows its clip has) is expanded
from the ledger, without reading its bytes; otherwise the clip is read once and probed (packets, not frames).
A clip that cannot be probed, or is too short for one window, stays one ref: its row gets the reason.
"""

from __future__ import annotations

import dataclasses
import functools

from infra.cache.ledger import WINDOWS_KEY, LedgerRow
from infra.errors import InputError
from infra.job import Job
from infra.media.temporal import TemporalPolicy, choose_windows
from infra.media.video import MediaLimits, probe_frames
from infra.sources import SampleRef


def expand(ref: SampleRef, job: Job, known: list[LedgerRow]) -> list[SampleRef]:
    """The samples of one source clip under the plan's temporal policy (itself, unless it is windows:K); `known`
    is the ledger's rows of the clip's windows (`ledger.windows_by_clip`)."""
    policy = TemporalPolicy.of(job.spec)
    if policy.kind != "windows":
        return [ref]
    if known and len(known) == known[0].extra[WINDOWS_KEY]:
        firsts = sorted(int(row.key.rpartition("@")[2]) for row in known)
        return [_window_ref(ref, first, ref.read_media) for first in firsts]
    read = functools.cache(ref.read_media)
    try:
        media = read()
        if media is None:
            return [ref]
        total, fps = probe_frames(media, limits=MediaLimits(job.limits.max_pixels, job.limits.max_frames))
        windows = choose_windows(policy, total, fps, job.spec.frames)
    except InputError:
        return [ref]  # encoding it gives the row its reason
    return [_window_ref(ref, w.first, read) for w in windows]


def _window_ref(ref: SampleRef, first: int, read) -> SampleRef:
    suffix = f"@{first}"
    return dataclasses.replace(
        ref,
        id=ref.id + suffix,
        key=ref.key + suffix,
        stem=ref.stem + suffix if ref.stem else "",
        read_media=read,
        read_together=None,  # its media is `read`, shared by the clip's windows
        window=first,
    )
