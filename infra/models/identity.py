"""Model identity: a cheap, content-based hash of a model component directory.

Config and tokenizer files are hashed whole. Weight files are large, so for them the hash covers
the safetensors header (tensor names, shapes, dtypes, offsets), the file size, and three 64 KiB
samples of the data (start, middle, end), which tells two fine-tunes of one architecture apart
without reading gigabytes.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf"})
_CHUNK = 64 * 1024
_WHOLE_FILE_LIMIT = 64 * 1024 * 1024


def _sampled_digest(path: Path, start: int = 0) -> bytes:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        for offset in sorted({start, max(start, (start + size) // 2), max(start, size - _CHUNK)}):
            fh.seek(offset)
            h.update(fh.read(_CHUNK))
    return h.digest()


def _safetensors_digest(path: Path) -> bytes:
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return hashlib.sha256(raw).digest()
        (header_len,) = struct.unpack("<Q", raw)
        header = fh.read(min(header_len, 100 * 1024 * 1024))
    return hashlib.sha256(header + _sampled_digest(path, 8 + len(header))).digest()


def file_digest(path: Path) -> bytes:
    """Digest of one file, by the rules above."""
    if path.suffix == ".safetensors":
        return _safetensors_digest(path)
    if path.suffix in WEIGHT_SUFFIXES or path.stat().st_size > _WHOLE_FILE_LIMIT:
        return _sampled_digest(path)
    return hashlib.sha256(path.read_bytes()).digest()


def component_identity(directory: Path) -> str:
    """sha256 over (relative name, file digest) of every visible file under `directory`."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts):
            continue  # download caches, lock files: not part of the model
        h.update(rel.as_posix().encode() + b"\0" + file_digest(path))
    return h.hexdigest()
