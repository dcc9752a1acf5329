"""Bounded reads: a source's media file or tar member is read only when its size is under ``--max-media-mb``.

The size is the one the file system or the tar header gives (a GNU-sparse member's is the size it expands to, not
the few bytes it stores), checked before any byte is read: over the cap, the sample is a ``too_large`` row and
nothing of it is held. A read then takes at most the size checked, so a file that grows after the check is cut,
never read whole. The decoders take the media as bytes (it is hashed, handed to decoder processes, and read more
than once for some roles), so the cap is what bounds a sample's memory, not a stream.
"""

from __future__ import annotations

import os
from pathlib import Path

from infra.errors import InputError

MIB = 1 << 20
#: Default of ``--max-media-mb`` (`infra.config.LimitsConfig` repeats it: config imports no source): far above any
#: training clip or image, far below what would kill a worker.
DEFAULT_MAX_MEDIA_MB = 2048
TOO_LARGE = "too_large"
FLAG = "--max-media-mb"


def check_size(name: str, size: int, max_mb: int, *, sparse: bool = False) -> None:
    """InputError ``too_large`` naming `name`, its `size` and the flag when `size` bytes is over `max_mb` MiB."""
    if size > max_mb * MIB:
        what = "a sparse tar member that expands to " if sparse else ""
        raise InputError(
            TOO_LARGE, f"{name}: {what}{size} bytes ({size / MIB:,.0f} MiB), over {FLAG} {max_mb}: not read"
        )


def read_file(path: Path, max_mb: int) -> bytes:
    """The bytes of the file at `path`, its size checked (`check_size`) on the file opened before any is read, and
    no more than that size read. OSError as `open` and `read` raise it."""
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        check_size(str(path), size, max_mb)
        return fh.read(size)
