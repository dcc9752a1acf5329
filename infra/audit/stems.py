"""Each sample's unique output stem: what reports, decode outputs and overfit references are named after."""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath

from infra.cache.ledger import LedgerRow
from infra.formats import Format
from infra.sources import is_safe_name


def sample_stem(row: LedgerRow, fmt: Format) -> str:
    """The sample's output stem, unique in its cache: the name its files were written under (the source's
    ``group/id``, ``dir/clip``, ``shard/key``, with ``@first`` for a window), without the format's folder and
    suffix; in a shard format its key in the part. Reports name a sample's files by it (``<stem>.png``), so two
    samples never share a name, whatever the source layout (two ``G-11/*/video.mp4`` are ``G-11/a/video`` and
    ``G-11/b/video``). A row whose stored name is not a safe relative path gets ``<group>/<sha256 of its shard
    and key>``, still unique."""
    file = row.file_of("latents") or next(iter(row.output_files()), None)
    stem = None
    if file is not None and file.member:
        stem = file.member
    elif file is not None:
        template = fmt.paths("\0", ["latents"]).get("latents", "\0")  # where a stem goes in the format's names
        before, _, after = template.partition("\0")
        path = file.path
        if path.startswith(before) and path.endswith(after) and len(path) > len(before) + len(after):
            stem = path[len(before) : len(path) - len(after)]
    parts = PurePosixPath(stem).parts if stem else ()
    if parts and all(is_safe_name(p) for p in parts):
        return "/".join(parts)
    digest = hashlib.sha256(f"{row.shard}\0{row.key}".encode()).hexdigest()[:16]
    return f"{row.group if is_safe_name(row.group) else 'ungrouped'}/{digest}"
