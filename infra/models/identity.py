"""Model identity: a hash of every byte of every file of a model component directory.

Scheme ``content`` (the default): sha256 over (relative name, sha256 of the file's content) of every visible
file. Content hashes are computed once per file and remembered by (resolved path, size, mtime_ns, inode) in a
per-user cache (`hash_cache_dir`), so a second plan reads no weight bytes. Where the content hash is already
known it is taken instead of hashing: a Hugging Face cache snapshot's file is a symlink into ``blobs/<sha256>``;
a ``hf download --local-dir`` folder has ``.cache/huggingface/download/<file>.metadata`` with the LFS sha256 as
its etag (trusted only while the file is not newer than that record). A safetensors file is first checked to be
as long as its own header says (a truncated download is hashed, not trusted, and fails to load anyway).

Scheme ``sampled`` (latentforge 0.1's): the safetensors header plus three 64 KiB samples of each weight
file. It missed most tensors of a fine-tune and is kept only to recognise, and resume, caches made with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import struct
import sys
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from infra import records
from infra.runtime import machine_cache
from infra.storage import atomic_write

logger = logging.getLogger(__name__)

Scheme = Literal["content", "sampled"]
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf"})
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_READ = 8 << 20
_PROGRESS_FROM = 256 << 20  # a progress bar for files this big (a first multi-GB encoder)
#: What this process hashed, for benchmarks and tests: bytes read to hash, files hashed, files known without.
stats = {"bytes_hashed": 0, "files_hashed": 0, "files_known": 0}


def hash_cache_dir() -> Path:
    """``$LATENTFORGE_CACHE_DIR/file-hashes``, else ``$XDG_CACHE_HOME/latentforge/file-hashes``, else
    ``~/.cache/latentforge/file-hashes``."""
    return machine_cache("file-hashes")


def _stat_key(path: Path) -> tuple[Path, str]:
    """The cache entry of a file: its resolved path, size, mtime_ns and inode (any change is a new entry)."""
    resolved = path.resolve()
    st = resolved.stat()
    key = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    return hash_cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json", key


def _remembered(entry: Path, key: str) -> str | None:
    try:  # a machine's own record, read back bounded: one that does not read back is absent (hashed again)
        data = records.loads(entry.read_bytes(), str(entry), "a file-hash record", "", records.MAX_SMALL_BYTES)
    except (OSError, records.DamagedRecord):
        return None
    digest = data.get("sha256") if isinstance(data, dict) and data.get("key") == key else None
    return digest if isinstance(digest, str) and _SHA256.match(digest) else None


def _remember(entry: Path, key: str, digest: str) -> None:
    try:
        atomic_write(entry, json.dumps({"key": key, "sha256": digest}).encode(), replace=True)
    except OSError as exc:  # a read-only home: the hash is still right, only not remembered
        logger.warning("cannot remember the hash of a model file in %s: %s", entry.parent, exc)


def _hash(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as fh, _progress(size, path.name) as bar:
        while chunk := fh.read(_READ):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    stats["bytes_hashed"] += size
    stats["files_hashed"] += 1
    return h.hexdigest()


def _progress(size: int, name: str) -> contextlib.AbstractContextManager[tqdm | None]:
    """A progress bar for a big file hashed with a terminal to show it on, else none. Not a disabled bar: tqdm
    starts its monitor thread for one and never ends it (a shown bar's ends with it), and a build's process forks
    its decode-ahead process only while no thread runs (`infra.preprocess.ahead`)."""
    if size < _PROGRESS_FROM or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {name}")


def _safetensors_whole(path: Path) -> bool:
    """A safetensors file is exactly as long as its header says: 8 + header + the last tensor's end offset."""
    try:
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > path.stat().st_size - 8:
                return False  # not a safetensors file (damaged, or another format under the name)
            header = json.loads(fh.read(header_len))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return path.stat().st_size == 8 + header_len + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def _known_sha256(path: Path, component: Path) -> str | None:
    """The content sha256 a Hugging Face download already recorded for `path`, or None."""
    if path.suffix == ".safetensors" and not _safetensors_whole(path):
        return None
    if path.is_symlink():
        target = path.resolve()
        if target.parent.name == "blobs" and _SHA256.match(target.name):
            return target.name
    for parent in (component, component.parent):  # the component is a folder of the downloaded model
        metadata = parent / ".cache" / "huggingface" / "download" / f"{path.relative_to(parent).as_posix()}.metadata"
        if metadata.is_file():
            try:
                _commit, etag, stamp = metadata.read_text(encoding="utf-8").splitlines()[:3]
                etag = etag.strip().strip('"')
                if _SHA256.match(etag) and path.stat().st_mtime - 1 <= float(stamp):
                    return etag
            except (OSError, ValueError):
                return None
            return None
    return None


def file_sha256(path: Path, component: Path | None = None) -> str:
    """The sha256 of a file's content: recorded by a Hugging Face download, remembered, or hashed now."""
    path = Path(path)
    known = _known_sha256(path, Path(component or path.parent))
    if known is not None:
        stats["files_known"] += 1
        return known
    entry, key = _stat_key(path)
    digest = _remembered(entry, key)
    if digest is None:
        digest = _hash(path)
        _remember(entry, key, digest)
    return digest


def _files(directory: Path) -> list[Path]:
    """Every visible file under `directory` (download caches and lock files, under dot names, left out)."""
    found = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        if not any(part.startswith(".") for part in path.relative_to(directory).parts):
            found.append(path)
    return found


def component_identity(directory: Path, scheme: Scheme = "content") -> str:
    """The identity of one component directory (``vae/``, ``text_encoder/``, ...) under `scheme`."""
    directory = Path(directory)
    h = hashlib.sha256()
    for path in _files(directory):
        rel = path.relative_to(directory).as_posix()
        digest = bytes.fromhex(file_sha256(path, directory)) if scheme == "content" else _sampled_digest(path)
        h.update(rel.encode() + b"\0" + digest)
    return h.hexdigest()


# ---- the sampled scheme of latentforge 0.1, kept to recognise caches made with it -------------------------

_CHUNK = 64 * 1024
_WHOLE_FILE_LIMIT = 64 * 1024 * 1024


def _samples(path: Path, start: int = 0) -> bytes:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        for offset in sorted({start, max(start, (start + size) // 2), max(start, size - _CHUNK)}):
            fh.seek(offset)
            h.update(fh.read(_CHUNK))
    return h.digest()


def _sampled_digest(path: Path) -> bytes:
    if path.suffix == ".safetensors":
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                return hashlib.sha256(raw).digest()
            (header_len,) = struct.unpack("<Q", raw)
            header = fh.read(min(header_len, 100 * 1024 * 1024))
        return hashlib.sha256(header + _samples(path, 8 + len(header))).digest()
    if path.suffix in WEIGHT_SUFFIXES or path.stat().st_size > _WHOLE_FILE_LIMIT:
        return _samples(path)
    return hashlib.sha256(path.read_bytes()).digest()
