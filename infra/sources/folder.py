"""A folder of images or videos with sidecar captions, ``folder:PATH``: ``a/b/cat.jpg`` + ``a/b/cat.txt``.

Media files (`IMAGE_SUFFIXES`, `VIDEO_SUFFIXES`) are found recursively, in sorted order; hidden files and
folders (a leading ``.``) are left out. Sample id = the media path relative to PATH (nested folders kept), its
outputs named by that path without its suffix, each name made safe (`infra.sources.names.output_part`: a safe
name is itself, ``sample 1080p`` becomes ``sample_1080p-<hash>``), group = its top-level folder ("" for a file at
the top). A name that is not UTF-8 is a ``bad_layout`` row, shown with its bytes escaped (``c\\xff.mp4``). The
caption is the file beside it with ``.txt`` for its suffix (absent: the sample is skipped, ``missing_prompt``).
The sorted list is cut into shards of `FILES_PER_SHARD` (``<folder name>-00000``, ...), so shards are by sorted
position: a file added that sorts before existing ones moves later samples into the next shard. Keep the folder
fixed while a cache is built from it (or add names that sort last).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path, PurePath, PurePosixPath

from infra.errors import InputError, SourceError
from infra.media.image import IMAGE_SUFFIXES
from infra.media.prompts import MAX_PROMPT_BYTES
from infra.outstore import is_url
from infra.sources import store
from infra.sources.base import (
    OUTSIDE_SOURCE,
    Problem,
    SampleRef,
    Shard,
    Source,
    is_safe_name,
    mark_duplicate,
    outside_root,
    register_source,
)
from infra.sources.bounded import DEFAULT_MAX_MEDIA_MB, read_file
from infra.sources.identity import MemberIdentity, SourceIdentity
from infra.sources.names import key_text, name_key, nameable, output_stem, store_key_problem

logger = logging.getLogger(__name__)

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi")
FILES_PER_SHARD = 1000


def list_media(root: Path) -> list[Path]:
    """Every media file under `root` (relative paths), sorted; hidden names left out."""
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if _is_media(rel) and path.is_file():
            found.append(rel)
    return sorted(found, key=lambda p: p.as_posix())


def _is_media(rel: PurePath) -> bool:
    return rel.suffix.lower() in IMAGE_SUFFIXES + VIDEO_SUFFIXES and not any(p.startswith(".") for p in rel.parts)


def _object_media(rel: str) -> bool:
    """Whether the object at key `rel` (below the folder's prefix, as listed: never normalised) is a sample: a media
    object, or one named like media whose key cannot name a sample (`store_key_problem`: a row that says why)."""
    if store_key_problem(rel) is not None:
        return PurePosixPath(rel.rpartition("/")[2]).suffix.lower() in IMAGE_SUFFIXES + VIDEO_SUFFIXES
    return _is_media(PurePosixPath(rel))


def list_objects(root: str) -> dict[str, store.Stat]:
    """Every object below the folder URL `root`, by its path relative to it, as listed: SourceError when the store
    cannot list it (no permission, no such bucket)."""
    try:
        found = store.find(root)
    except FileNotFoundError:
        found = {}
    except OSError as exc:
        raise SourceError(f"folder source {store.shown(root)!r}: cannot be listed ({exc})") from exc
    base = store.join(root, "")
    return {url[len(base) :]: stat for url, stat in found.items() if url.startswith(base)}


@register_source("folder")
class FolderSource(Source):
    """Images or videos with ``.txt`` captions beside them, in nested folders. A file (or caption) that is a link
    out of the folder is not read (skipped, ``outside_source``) unless `follow_symlinks`."""

    settings = ("follow_symlinks", "max_media_mb")

    def __init__(self, path: str, follow_symlinks: bool = False, max_media_mb: int = DEFAULT_MAX_MEDIA_MB) -> None:
        #: A folder in a store (`infra.sources.store`): its URL, its objects listed once; None: a local folder.
        self.url = path.rstrip("/") if is_url(path) else None
        self._objects: dict[str, store.Stat] | None = None
        self.root = Path(path).expanduser() if self.url is None else Path(store.name(path))
        self.follow_symlinks = follow_symlinks
        self.max_media_mb = max_media_mb  # a file over it: skipped too_large, before it is read
        name = self.root.resolve().name if self.url is None else store.name(self.url)
        self.prefix = name if is_safe_name(name) else "folder"

    def _files(self) -> list[PurePath] | list[str]:
        if self.url is not None:  # keys as listed (a path would read "a//b" as "a/b")
            if self._objects is None:
                self._objects = list_objects(self.url)
            return sorted(rel for rel in self._objects if _object_media(rel))
        if not self.root.is_dir():
            raise SourceError(f"folder source {str(self.root)!r}: not a directory")
        return list_media(self.root)

    def shards(self) -> list[Shard]:
        files = self._files()
        if not files:
            raise SourceError(f"folder source {store.shown(self.url or str(self.root))!r}: no images or videos found")
        count = -(-len(files) // FILES_PER_SHARD)
        return [Shard(id=f"{self.prefix}-{i:05d}", path=self.url or str(self.root)) for i in range(count)]

    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        index = int(shard.id.rpartition("-")[2])
        chunk = self._files()[index * FILES_PER_SHARD : (index + 1) * FILES_PER_SHARD]
        for rel in chunk:
            ref = self._ref(rel) if isinstance(rel, Path) else self._object_ref(str(rel))
            yield mark_duplicate(ref, shard)

    def _object_ref(self, key: str) -> SampleRef:
        """`_ref` of a media object in a store: its members by size and version as listed (no link to follow); an
        object whose key cannot name a sample (`store_key_problem`), a ``bad_layout`` row saying why."""
        assert self.url is not None and self._objects is not None
        if (why := store_key_problem(key)) is not None:
            return _unsafe_key(key, why, store.shown(self.url))
        rel = PurePosixPath(key)
        sid = name_key(rel.as_posix())
        parts = (*rel.parent.parts, rel.stem)
        bad = [p for p in parts if not nameable(p)]
        problems = {Problem.BAD_LAYOUT: f"a name that is not UTF-8 cannot name an output: {sid}"} if bad else {}
        caption = rel.with_suffix(".txt")
        listed = {rel.name: rel, **({caption.name: caption} if caption.as_posix() in self._objects else {})}
        stats = {name: self._objects[path.as_posix()] for name, path in listed.items()}
        members = {name_key(n): MemberIdentity(size=st.size, mtime=0, version=st.version) for n, st in stats.items()}
        identity = SourceIdentity(members=members)
        url, max_mb = self.url, self.max_media_mb
        return SampleRef(
            id=sid,
            group=name_key(rel.parts[0]) if len(rel.parts) > 1 else "",
            key=sid,
            read_media=lambda: _read_object(store.join(url, rel.as_posix()), identity, max_mb),
            read_prompt=lambda: (
                _read_object(store.join(url, caption.as_posix()), identity, max_mb, prompt=True)
                if caption.name in listed
                else None
            ),
            problems=problems,
            identity=identity,
            stem="" if bad else output_stem(parts),
        )

    def _ref(self, rel: Path) -> SampleRef:
        media, caption = self.root / rel, (self.root / rel).with_suffix(".txt")
        sid = name_key(rel.as_posix())
        parts = (*rel.parent.parts, rel.stem)
        bad = [p for p in parts if not nameable(p)]
        problems = {Problem.BAD_LAYOUT: f"a name that is not UTF-8 cannot name an output: {sid}"} if bad else {}
        if outside := self._outside(media) or self._outside(caption):
            problems[Problem.OUTSIDE_SOURCE] = outside  # nothing of it is read, not even its size
        listed = {rel.name: media} if not outside else {}
        if caption.is_file() and not outside:
            listed[caption.name] = caption
        members = {}
        for name, path in listed.items():
            st = path.stat()
            members[name_key(name)] = MemberIdentity(size=st.st_size, mtime=st.st_mtime)
        identity = SourceIdentity(members=members)
        captioned = name_key(caption.name) in members
        return SampleRef(
            id=sid,
            group=name_key(rel.parts[0]) if len(rel.parts) > 1 else "",
            key=sid,
            read_media=lambda: _read(self._inside(media), identity, self.max_media_mb),
            read_prompt=lambda: (
                _read(self._inside(caption), identity, self.max_media_mb, prompt=True) if captioned else None
            ),
            problems=problems,
            identity=identity,
            stem="" if bad else output_stem(parts),
        )

    def _outside(self, path: Path) -> str | None:
        return outside_root(self.root, path, follow_symlinks=self.follow_symlinks)

    def _inside(self, path: Path) -> Path:
        """`path`, checked again as it is read (a link swapped in since the listing): InputError when outside."""
        if why := self._outside(path):
            raise InputError(OUTSIDE_SOURCE, why)
        return path


def _unsafe_key(key: str, why: str, where: str) -> SampleRef:
    """The sample of an object below `where` whose `key` cannot name one: nothing of it is read."""
    sid = key_text(key)
    detail = f"the object '{sid}' below {where} {why}: not read"

    def refused() -> bytes | None:
        raise InputError(Problem.BAD_LAYOUT.value, detail)

    return SampleRef(
        id=sid, group="", key=sid, read_media=refused, read_prompt=refused, problems={Problem.BAD_LAYOUT: detail}
    )


def _read(path: Path, identity: SourceIdentity, max_mb: int, *, prompt: bool = False) -> bytes | None:
    """The file's bytes (sha256 noted), after checking it is the file listed and not too large to read (a caption
    over `MAX_PROMPT_BYTES`, media over `max_mb` MiB: `infra.sources.bounded`); InputError when it changed."""
    listed = identity.members.get(name_key(path.name))
    try:
        st = path.stat()
        if listed is not None and (st.st_size != listed.size or st.st_mtime != listed.mtime):
            raise InputError("source_changed", f"{path} changed since it was listed: not read")
        if prompt and st.st_size > MAX_PROMPT_BYTES:
            raise InputError("prompt_too_long", f"{path}: {st.st_size} bytes, over {MAX_PROMPT_BYTES}: not read")
        data = read_file(path, max_mb)
    except FileNotFoundError:
        raise InputError("source_vanished", f"{path} vanished since it was listed") from None
    except OSError as exc:
        raise InputError("member_unreadable", f"{path}: {exc}") from exc
    identity.read_sha256[name_key(path.name)] = hashlib.sha256(data).hexdigest()
    return data


def _read_object(url: str, identity: SourceIdentity, max_mb: int, *, prompt: bool = False) -> bytes:
    """`_read` of an object in a store: checked against its listing (size, version) before a byte is fetched."""
    listed = identity.members[name_key(store.name(url))]
    if prompt and listed.size > MAX_PROMPT_BYTES:
        why = f"{store.shown(url)}: {listed.size} bytes, over {MAX_PROMPT_BYTES}: not read"
        raise InputError("prompt_too_long", why)
    data = store.read(url, store.Stat(listed.size, listed.version or ""), max_mb)
    identity.read_sha256[name_key(store.name(url))] = hashlib.sha256(data).hexdigest()
    return data
