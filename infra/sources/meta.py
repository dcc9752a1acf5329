"""Metadata-file sources, ``meta:PATH``: a ``.csv``, a ``.json`` (a list of objects) or a ``.jsonl`` file listing
media files and their captions, as the LTX-2 trainer and FastVideo read them.

Columns, named as the LTX-2 trainer detects them: ``video`` (legacy alias ``media_path``; FastVideo's
``videos2caption.json``: ``path``), ``caption`` (FastVideo: ``cap``, a string or a list: its first entry is taken),
optional ``audio`` (a separate audio file; in an audio-only mode, t2a ..., the sample itself), and the roles its
LTX-2 mode reads (`ROLE_COLUMNS`: ``reference_video`` or the legacy ``ref_media_path``, ``reference_audio``,
``video_mask``, ``audio_mask``); ``--video-column`` / ``--caption-column`` name others (a name the file does not
have is an error here, where the trainer ignores it). A caption given as ``""`` is the empty caption
(``--empty-captions`` decides it); a row without one is ``missing_prompt``. A media file listed twice: the first
row is the sample (the later ones are ``bad_layout`` rows), or with ``--duplicate-rows last`` the last row, as the
trainer keeps its caption (the earlier ones are ``superseded`` rows).

Media paths are relative to the metadata file's directory; an absolute path is mirrored without its root, as the
trainer names its outputs. Sample id = the media path relative to that directory; its outputs are named by
that path without its extension, each name made safe (`infra.sources.names.output_part`: a safe name is itself).
A caption that is not UTF-8 (a JSON lone surrogate) is that sample's ``prompt_not_utf8`` row. A listed file that
is missing or unreadable is a ledger row (``missing_video``, ...), never an abort of the run; so is a row that
cannot be a sample (a path of the wrong type or with a NUL, a line that is not JSON: `infra.sources.meta_rows`), a
``bad_row`` row.

Rows are split into shards of `ROWS_PER_SHARD` (``<file stem>-00000``, ...), the unit of work and resume. The
parsed file is kept per process, keyed by its path, size and mtime, so the shard tasks do not parse it again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from infra.errors import InputError, SourceError
from infra.models import ROLES, TEXT_TO_VIDEO, mode_roles
from infra.outstore import is_url
from infra.sources import store
from infra.sources.base import (
    OUTSIDE_SOURCE,
    Problem,
    SampleRef,
    Shard,
    Source,
    mark_duplicate,
    outside_root,
    register_source,
)
from infra.sources.bounded import DEFAULT_MAX_MEDIA_MB, read_file
from infra.sources.identity import MemberIdentity, SourceIdentity
from infra.sources.meta_rows import Row, decode, entries, make_row
from infra.sources.names import key_text, nameable, output_stem, safe_text, store_key_problem
from infra.urls import redacted

logger = logging.getLogger(__name__)

ROWS_PER_SHARD = 1000
VIDEO_COLUMNS = ("video", "media_path", "path")
CAPTION_COLUMNS = ("caption", "cap")
#: The trainer's legacy names of a role's column.
LEGACY_COLUMNS: dict[str, tuple[str, ...]] = {"reference_video": ("ref_media_path",)}
#: The other roles a mode may read (`infra.models.base.ROLES`, past the video, caption and audio columns) → their
#: columns: the role's own name, then the trainer's legacy alias. A sample reads those its mode needs
#: (`SampleRef.read_roles`).
ROLE_COLUMNS: dict[str, tuple[str, ...]] = {
    role: (role, *LEGACY_COLUMNS.get(role, ())) for role in ROLES if role not in ("video", "caption", "audio")
}
SUFFIXES = (".csv", ".json", ".jsonl")


@functools.lru_cache(maxsize=4)
def _parse(
    path: str,
    size: int,
    mtime_ns: int | str,
    video_column: str | None = None,
    caption_column: str | None = None,
    video_flag: str = "--video-column",
) -> tuple[Row, ...]:
    """Every row of the metadata file (cached per process by path, size, mtime and the columns asked for); a row
    that cannot be a sample has its `Row.problem` (`infra.sources.meta_rows`)."""
    text = decode(store.read_whole(path) if is_url(path) else Path(path).read_bytes())
    video_names = (video_column,) if video_column else VIDEO_COLUMNS
    caption_names = (caption_column,) if caption_column else CAPTION_COLUMNS
    found, columns = entries(text, PurePosixPath(path).suffix.lower(), store.shown(path))
    if columns is not None and not columns & set(video_names):
        raise SourceError(f"{path}: no video column (one of {', '.join(video_names)}); columns: {sorted(columns)}")
    for given, flag in ((video_column, video_flag), (caption_column, "--caption-column")):
        if given and not any(isinstance(e, dict) and given in e for e in found):
            raise SourceError(f"{path}: {flag} {given!r}: no row has that column")
    return tuple(make_row(i, entry, (video_names, caption_names), ROLE_COLUMNS) for i, entry in enumerate(found))


def sample_id(media: str) -> str | None:
    """The media path as a sample id (posix, relative; an absolute path without its root); None when it cannot
    name an output (``..``, empty parts, a NUL, a name that is not UTF-8). Other names are made safe for paths by
    `output_stem`."""
    parts = PurePosixPath(media.replace("\\", "/")).parts
    parts = parts[1:] if parts and parts[0] == "/" else parts
    if not parts or not all(nameable(p) for p in parts):
        return None
    return "/".join(parts)


@register_source("meta")
class MetaSource(Source):
    """A metadata file (csv, json, jsonl; the LTX-2 trainer's or FastVideo's columns) listing media and captions."""

    settings = ("video_column", "caption_column", "duplicate_rows", "mode", "follow_symlinks", "max_media_mb")

    def __init__(
        self,
        path: str,
        video_column: str | None = None,
        caption_column: str | None = None,
        duplicate_rows: str = "refuse",
        mode: str | None = None,
        follow_symlinks: bool = False,
        max_media_mb: int = DEFAULT_MAX_MEDIA_MB,
    ) -> None:
        #: A metadata file in a store (`infra.sources.store`): its URL; its rows' media are read from its folder
        #: there. None: a local file.
        self.url = path if is_url(path) else None
        self.path = Path(path).expanduser() if self.url is None else Path(store.name(path))
        self.max_media_mb = max_media_mb  # a listed file over it: skipped too_large, before it is read
        self.follow_symlinks = follow_symlinks  # a relative media path that leads out of the file's folder: read
        if self.path.suffix.lower() not in SUFFIXES:
            raise SourceError(f"meta source {store.shown(path)!r}: expected a {', '.join(SUFFIXES)} file")
        self.root = self.path.parent
        reads = mode_roles(mode) if mode is not None else TEXT_TO_VIDEO  # the roles the mode's samples read
        #: An audio-only mode (t2a ...): a sample is its ``audio`` file, named by it, as the trainer names it.
        self.audio_only = "video" not in reads
        self.columns = (video_column or ("audio" if self.audio_only else None), caption_column)
        own = self.audio_only and not video_column
        self.video_flag = f"--mode {mode} reads its samples from the column" if own else "--video-column"
        self.duplicate_rows = duplicate_rows
        #: The roles past video, audio and caption that the mode reads (a reference video, a mask ...).
        self.roles = tuple(role for role in reads if role in ROLE_COLUMNS)

    def rows(self) -> tuple[Row, ...]:
        if self.url is not None:
            return self._object_rows()
        try:
            st = self.path.stat()
            return _parse(str(self.path.resolve()), st.st_size, st.st_mtime_ns, *self.columns, self.video_flag)
        except FileNotFoundError as exc:
            raise SourceError(f"meta source {self.path}: no such file") from exc
        except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
            raise SourceError(f"meta source {self.path}: cannot be read ({exc})") from exc

    def shards(self) -> list[Shard]:
        rows = self.rows()
        if not rows:
            raise SourceError(f"meta source {self.path}: lists no sample")
        for role in self.roles:
            if not any(role in dict(row.roles) for row in rows):
                raise SourceError(
                    f"meta source {self.path}: the mode reads the role {role} (column "
                    f"{' or '.join(ROLE_COLUMNS[role])}), which no row has"
                )
        size = self.path.stat().st_size if self.url is None else self._object_stat().size
        stem = self.path.stem
        count = -(-len(rows) // ROWS_PER_SHARD)
        return [Shard(id=f"{stem}-{i:05d}", path=self.url or str(self.path), size=size) for i in range(count)]

    def _object_stat(self) -> store.Stat:
        assert self.url is not None
        try:
            return store.stat(self.url)
        except FileNotFoundError as exc:
            try:
                store.check_bucket(store.filesystem(self.url)[0], self.url)
            except store.NoSuchBucket as missing:
                raise SourceError(f"meta source {store.shown(self.url)}: cannot be read ({missing})") from exc
            raise SourceError(f"meta source {store.shown(self.url)}: no such object") from exc
        except OSError as exc:  # no permission, no such bucket
            raise SourceError(f"meta source {store.shown(self.url)}: cannot be read ({exc})") from exc

    def _object_rows(self) -> tuple[Row, ...]:
        """`rows` of a metadata file in a store: parsed once per process for each version of it."""
        assert self.url is not None
        now = self._object_stat()
        try:
            return _parse(self.url, now.size, now.version, *self.columns, self.video_flag)
        except OSError as exc:
            raise SourceError(f"meta source {store.shown(self.url)}: cannot be read ({exc})") from exc
        except ValueError as exc:  # not UTF-8, not JSON
            raise SourceError(f"meta source {store.shown(self.url)}: cannot be read ({exc})") from exc

    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        number = int(shard.id.rsplit("-", 1)[1])
        rows = self.rows()[number * ROWS_PER_SHARD : (number + 1) * ROWS_PER_SHARD]
        seen: set[str] = set()
        last = self._last_rows() if self.duplicate_rows == "last" else {}
        for row in rows:
            yield mark_duplicate(self._ref(row, seen, last), shard)

    def _last_rows(self) -> dict[str, int]:
        """Each listed media file's last row (over the whole file: the trainer keeps the last caption)."""
        rows = self.rows()
        return {sid: row.index for row in rows if row.problem is None and (sid := sample_id(row.media)) is not None}

    def _ref(self, row: Row, seen: set[str], last: dict[str, int]) -> SampleRef:
        if row.problem is not None:
            return _bad_row(row)
        sid = sample_id(row.media)
        problems: dict[Problem, str] = {}
        if sid is None:
            problems[Problem.BAD_LAYOUT] = (
                f"row {row.index + 1}: media path {row.media!r} cannot name an output under OUT"
            )
        elif last.get(sid, row.index) != row.index:
            problems[Problem.SUPERSEDED] = (
                f"row {row.index + 1}: {row.media!r} is listed again in row {last[sid] + 1}, whose caption is the "
                "sample's (--duplicate-rows last)"
            )
        elif sid in seen:
            problems[Problem.BAD_LAYOUT] = f"row {row.index + 1}: {row.media!r} is listed twice in this shard"
        key = sid if sid is not None and not problems else f"row-{row.index + 1:08d}"
        seen.add(key)
        media = self._where(row.media) if sid is not None else None
        audio = self._where(row.audio) if row.audio and not self.audio_only else None
        listed = dict(row.roles)
        roles = {role: self._where(listed[role]) if listed.get(role) else None for role in self.roles}
        # A caption with a lone surrogate (JSON "\udcff") keeps it as bytes that are not UTF-8: prompt_not_utf8.
        caption = None if row.caption is None else row.caption.encode("utf-8", "surrogatepass")
        files = {"video": media, "audio": audio, **roles}
        if outside := self._outside([row.media, row.audio or "", *listed.values()]):
            problems[Problem.OUTSIDE_SOURCE] = outside  # nothing of it is read, not even its size
        identity = SourceIdentity(members=_members(files if not outside else {}, caption))
        parts = (sid or key).split("/")
        return SampleRef(
            id=sid or key,
            group=parts[0] if len(parts) > 1 else "root",
            key=key,
            read_media=functools.partial(self._read, media, "video", identity, row.media),
            read_prompt=lambda: caption,
            read_audio=None if audio is None else functools.partial(self._read, audio, "audio", identity, row.audio),
            read_roles={
                role: functools.partial(self._read, path, role, identity, listed.get(role) or "")
                for role, path in roles.items()
            },
            problems=problems,
            identity=identity,
            stem=output_stem(PurePosixPath(sid).with_suffix("").parts) if sid is not None and not problems else "",
        )

    def _where(self, entry: str) -> Path | str:
        """Where a row's media path `entry` is: below the metadata file's folder (its URL's for a file in a store)."""
        return self.root / entry if self.url is None else store.join(store.parent(self.url), entry)

    def _outside(self, listed: list[str]) -> str | None:
        """Why a relative media path of a row may not be read: it leads out of the metadata file's folder (an
        absolute path is the user's own choice of place; in a store, where a row's path can only be relative to the
        metadata file, an absolute path or a ``..`` is outside it)."""
        if self.url is not None:  # a key is taken as it is: one a path would read otherwise is refused
            found = ((e, why) for e in listed if e and (why := _key_refusal(e)) is not None)
            bad = next(found, None)
            if bad is None:
                return None
            where, shown = store.shown(store.parent(self.url)), key_text(redacted(bad[0]))
            return f"'{shown}' is not below {where}, the metadata file's folder: it {bad[1]}; not read"
        relative = [entry for entry in listed if entry and not PurePosixPath(entry).is_absolute()]
        found = (outside_root(self.root, self.root / e, follow_symlinks=self.follow_symlinks) for e in relative)
        return next((why for why in found if why), None)

    def _read(self, path: Path | str | None, name: str, identity: SourceIdentity, entry: str | None) -> bytes | None:
        """`_read` of the file the row lists as `entry`, checked again as it is read (a link swapped in since the
        listing)."""
        if why := self._outside([entry or ""]):
            raise InputError(OUTSIDE_SOURCE, why)
        return _read(path, name, identity, self.max_media_mb)


def _key_refusal(entry: str) -> str | None:
    """Why a row's media path cannot be read below a metadata file in a store (a key is taken as it is), or None."""
    path = entry.replace("\\", "/")
    if "://" in entry:
        return "is a URL of its own"
    if path.startswith("/"):
        return "is an absolute path"
    return store_key_problem(path)


def _bad_row(row: Row) -> SampleRef:
    """The sample of a row that cannot be one (`Row.problem`): nothing of it is read; its ledger row, ``bad_row``."""
    key = f"row-{row.index + 1:08d}"
    return SampleRef(
        id=key,
        group="root",
        key=key,
        read_media=lambda: None,
        read_prompt=lambda: None,
        problems={Problem.BAD_ROW: f"row {row.index + 1}: {safe_text(row.problem or '')}"},
    )


def _members(files: dict[str, Path | str | None], caption: bytes | None) -> dict[str, MemberIdentity]:
    """The sample's members as listed: media files (video, audio, the mode's other roles) by size and mtime (an
    object in a store by size and version), the caption by its hash."""
    members = {}
    for name, path in files.items():
        if isinstance(path, str):
            try:
                now = store.stat(path)
            except OSError:  # missing or not readable: the sample's reader says so
                continue
            members[name] = MemberIdentity(size=now.size, mtime=0, version=now.version or None)
        elif path is not None:
            try:
                st = path.stat()
                members[name] = MemberIdentity(size=st.st_size, mtime=st.st_mtime)
            except (OSError, ValueError):  # ValueError: a path the OS cannot take (a NUL, a lone surrogate)
                continue  # missing: the sample's reader says so
    if caption is not None:
        members["caption"] = MemberIdentity(size=len(caption), mtime=0, sha256=hashlib.sha256(caption).hexdigest())
    return members


def _read(path: Path | str | None, name: str, identity: SourceIdentity, max_mb: int) -> bytes | None:
    """A listed file's bytes (their sha256 noted in `identity`); None when it is not there; InputError
    ``too_large`` for one over `max_mb` MiB, nothing of it read (`infra.sources.bounded`). An object in a store:
    checked against its listing (``source_changed``, ``source_vanished``) before a byte is fetched."""
    if isinstance(path, str):
        listed = identity.members.get(name)
        if listed is None:
            return None  # not there when listed
        data = store.read(path, store.Stat(listed.size, listed.version or ""), max_mb, reason=f"{name}_unreadable")
        identity.read_sha256[name] = hashlib.sha256(data).hexdigest()
        return data
    if path is None or not path.exists():
        return None
    try:
        data = read_file(path, max_mb)
    except OSError as exc:  # a directory, no permission
        raise InputError(f"{name}_unreadable", f"{path}: {exc}") from exc
    identity.read_sha256[name] = hashlib.sha256(data).hexdigest()
    return data
