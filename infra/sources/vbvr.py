"""VBVR tar shards: ``{generator}/{task}_task/{task}_{8 digits}/{ground_truth.mp4, prompt.txt, ...}``.

Members are read straight from the tar (random access on plain tars, forward reads on compressed
ones); nothing is extracted to disk. group = the generator directory, id = the sample directory.

Before each member is read the shard file is checked against its listing (size and mtime): a shard that
vanished or changed since it was planned gives the samples not yet read a reason (``shard_vanished``,
``shard_changed``), never bytes of another file.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import re
import tarfile
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import IO, Any

from infra.errors import InputError, SourceError
from infra.media.prompts import MAX_PROMPT_BYTES
from infra.outstore import is_url
from infra.sources import store
from infra.sources.base import (
    Problem,
    SampleRef,
    Shard,
    ShardReadError,
    Source,
    is_safe_name,
    mark_duplicate,
    refuse_outside,
    register_source,
)
from infra.sources.bounded import DEFAULT_MAX_MEDIA_MB
from infra.sources.identity import MemberIdentity, SourceIdentity
from infra.sources.names import is_text, key_text, name_key, store_key_problem
from infra.sources.relist import Relisting, made, read_headers
from infra.sources.tars import (
    PLAIN_TAR,
    BadRecord,
    Member,
    TarDamaged,
    cut,
    from_record,
    opened_from,
    read_member,
    read_span,
    record,
    scan,
    span,
    stream_of,
)

__all__ = [
    "ShardReadError",
    "VbvrSource",
    "check_unchanged",
    "open_shard_tar",
    "read_failed",
    "read_side_by_side",
    "shard_id_for",
    "tar_shards",
]

logger = logging.getLogger(__name__)

VIDEO_MEMBER = "ground_truth.mp4"
PROMPT_MEMBER = "prompt.txt"
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_SAMPLE_DIR = re.compile(r"(?:^|.*/)(?P<group>[^/]+)/(?P<task>[^/]+)_task/(?P<id>(?P=task)_\d{8})$")


@dataclass(slots=True)
class _SampleMembers:
    """A sample directory as listed: its video and prompt members (`tars.Member` records, not tarfile's headers)."""

    directory: str
    video: Member | None = None
    prompt: Member | None = None
    cut: bool = False  # the last sample listed before the tar's damage: a member it lacks may be past the cut
    proven: bool = True  # listed from the tar's headers; made from a record: proven where it is read (`relist`)
    listed_now: bool = True  # listed from the tar's headers (not made from a record)

    @property
    def name(self) -> str:
        return self.directory

    def members(self) -> dict[str, Member]:
        return {n: m for n, m in ((VIDEO_MEMBER, self.video), (PROMPT_MEMBER, self.prompt)) if m is not None}

    def checks(self) -> list[tuple[Member, Callable[[str], bool]]]:
        """Each member, with what accepts its header's name (`relist.Recorded`)."""
        return [(m, functools.partial(_is_member, f"{self.directory}/{n}")) for n, m in self.members().items()]

    def adopt(self, found: _SampleMembers) -> None:
        self.video, self.prompt, self.cut = found.video, found.prompt, found.cut

    def record(self) -> list[Any]:
        """What it was listed as, a JSON value (`SampleRef.listed`)."""
        return [self.directory, record(self.video), record(self.prompt), self.cut]

    @classmethod
    def from_record(cls, value: Any, tar_size: int = 0) -> _SampleMembers:
        """The sample `record` made `value` from, not yet proven; BadRecord for another shape."""
        if not isinstance(value, list) or len(value) != 4 or not isinstance(value[0], str):
            raise BadRecord(f"a sample record is [directory, video, prompt, cut], not {str(value)[:120]}")
        directory, video, prompt, cut = value
        if not isinstance(cut, bool) or (video is None and prompt is None and not _SAMPLE_DIR.match(directory)):
            raise BadRecord(f"a sample record is [directory, video, prompt, cut], not {str(value)[:120]}")
        made = cls(directory, from_record(video, tar_size), from_record(prompt, tar_size), cut)
        made.proven = made.listed_now = False
        return made


def _is_member(path: str, name: str) -> bool:
    """Whether a header's `name` is the member at `path` (as the listing names it: without a leading ``./``)."""
    return name.removeprefix("./") == path


def shard_id_for(path: PurePath) -> str:
    """The shard id: the file name without its tar suffix."""
    name = path.name
    for suffix in TAR_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def tar_shards(tars: list[Path] | dict[str, store.Stat]) -> list[Shard]:
    """One shard per tar file (local paths, or objects in a store by URL as listed), its id from the file name
    (safe and unique, or a SourceError naming both files)."""
    shards: dict[str, Shard] = {}
    for tar in tars:
        name = PurePosixPath(tar).name if isinstance(tar, str) else tar.name
        sid = shard_id_for(PurePosixPath(name))
        if not is_safe_name(sid):
            raise SourceError(f"shard file name {name!r} cannot be used as a shard id")
        if sid in shards:
            raise SourceError(f"two shards share the id {sid!r}: {shards[sid].path} and {tar}")
        if isinstance(tars, dict):
            listed = tars[tar]
            shards[sid] = Shard(id=sid, path=str(tar), size=listed.size, version=listed.version)
            continue
        stat = tar.stat()
        shards[sid] = Shard(id=sid, path=str(tar), size=stat.st_size, mtime_ns=stat.st_mtime_ns)
    return list(shards.values())


def open_shard_tar(shard: Shard) -> tarfile.TarFile:
    """The shard's tar, opened for streaming its members (an object in a store: as a stream of range requests,
    `infra.sources.store.open_stream`); ShardReadError when it is gone or not a tar."""
    try:
        if is_url(shard.path):
            stream = store.open_stream(shard.path)
            tf = tarfile.open(fileobj=stream, mode="r:*")
            weakref.finalize(tf, stream.close)  # tarfile leaves a file it was handed open when it closes
            opened_from(tf, stream)
            return tf
        return tarfile.open(shard.path, "r:*")
    except FileNotFoundError as exc:
        raise ShardReadError(f"{shard.path}: the shard vanished since it was listed") from exc
    except (tarfile.TarError, OSError) as exc:
        raise ShardReadError(f"{shard.path}: not a readable tar ({exc})") from exc


def find_store_tars(spec: str, kind: str) -> dict[str, store.Stat]:
    """The tars a URL names (a pattern, a folder searched recursively, one object), by URL as listed."""
    try:
        found = store.find(spec)
    except FileNotFoundError:
        found = {}
    except OSError as exc:  # no permission, no such bucket: the run cannot list its source
        raise SourceError(f"{kind} source {store.shown(spec)!r}: cannot be listed ({exc})") from exc
    tars = {url: stat for url, stat in found.items() if url.endswith(TAR_SUFFIXES)}
    for url in tars:  # a shard is the unit of work: one a path would read otherwise is refused, not skipped
        key = url.partition("://")[2].partition("/")[2]
        problem = store_key_problem(key)
        if problem is not None:
            raise SourceError(f"{kind} source {store.shown(spec)!r}: the tar {key_text(key)!r} {problem}: not read")
    return tars


def _find_tars(spec: str, follow_symlinks: bool = False) -> list[Path] | dict[str, store.Stat]:
    if is_url(spec):
        return find_store_tars(spec, "vbvr")
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        found = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file()]
    elif path.is_file():
        found = [path]
    else:
        raise SourceError(f"vbvr source {spec!r}: no such file or directory")
    tars = sorted(p for p in found if p.name.endswith(TAR_SUFFIXES))
    refuse_outside(spec, tars, f"vbvr source {spec!r}", follow_symlinks=follow_symlinks)
    return tars


@register_source("vbvr")
class VbvrSource(Source):
    """A directory of VBVR tar shards, one tar, or a glob."""

    settings = ("follow_symlinks", "max_media_mb")

    def __init__(self, path: str, follow_symlinks: bool = False, max_media_mb: int = DEFAULT_MAX_MEDIA_MB) -> None:
        self.path = path
        self.follow_symlinks = follow_symlinks  # a shard file that is a link out of the source's folder: listed
        self.max_media_mb = max_media_mb  # a member over it (a sparse one at its expanded size): skipped too_large

    def shards(self) -> list[Shard]:
        tars = _find_tars(self.path, self.follow_symlinks)
        if not tars:
            raise SourceError(f"vbvr source {self.path!r}: no tar shards found ({', '.join(TAR_SUFFIXES)})")
        return tar_shards(tars)

    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        """Yield the shard's samples in tar order; raise ShardReadError at the end if the tar is damaged."""
        with open_shard_tar(shard) as tf:
            groups, error = _list_members(tf)
            if error is not None and groups:
                groups[-1].cut = True
            for sample in groups:
                yield mark_duplicate(_to_ref(tf, sample, shard, self.max_media_mb), shard)
        if error is not None:
            raise ShardReadError(f"{shard.path}: {error} (listed {len(groups)} samples before it)")

    def relisted(self, shard: Shard, records: Iterator[Any], spot: bool = False) -> Iterator[SampleRef]:
        """The samples as `samples` listed them (their records, in order), the tar opened but its headers not
        read (`infra.preprocess.kept`); each record proven where its bytes are read (`infra.sources.relist`)."""
        relisting: Relisting[_SampleMembers] = Relisting(shard, _listed_now, open_shard_tar)
        with open_shard_tar(shard) as tf:
            for sample in made(relisting, records, _SampleMembers.from_record, tf, spot):
                yield mark_duplicate(_to_ref(tf, sample, shard, self.max_media_mb, relisting), shard)


def _listed_now(tf: tarfile.TarFile) -> tuple[list[_SampleMembers], str | None]:
    groups, error = _list_members(tf)
    if error is not None and groups:
        groups[-1].cut = True
    return groups, error


def _list_members(tf: tarfile.TarFile) -> tuple[list[_SampleMembers], str | None]:
    """Group file members by sample directory, in first-seen order (headers only, kept as `tars.Member` records);
    the damage that stopped the listing, or None."""
    by_dir: dict[str, _SampleMembers] = {}
    ignored, error = 0, None
    try:
        for path, member in scan(tf):
            directory, _, name = path.removeprefix("./").rpartition("/")
            if name == VIDEO_MEMBER:
                by_dir.setdefault(directory, _SampleMembers(directory)).video = member
            elif name == PROMPT_MEMBER:
                by_dir.setdefault(directory, _SampleMembers(directory)).prompt = member
            elif member.regular and _SAMPLE_DIR.match(directory):
                by_dir.setdefault(directory, _SampleMembers(directory))  # a sample dir without either member
            else:
                ignored += 1
    except TarDamaged as exc:
        error = str(exc)
    logger.debug("%d members ignored in %s", ignored, tf.name)
    return list(by_dir.values()), error


def _to_ref(
    tf: tarfile.TarFile,
    sample: _SampleMembers,
    shard: Shard,
    max_mb: int,
    relisting: Relisting[_SampleMembers] | None = None,
) -> SampleRef:
    match = _SAMPLE_DIR.match(sample.directory)
    group, sid = (match["group"], match["id"]) if match else ("", sample.directory)
    problems: dict[Problem, str] = {}
    parts = sample.directory.split("/")
    shown = name_key(sample.directory)
    if sample.directory and (sample.directory.startswith("/") or any(p in ("", ".", "..") for p in parts)):
        problems[Problem.BAD_LAYOUT] = f"unsafe member path (absolute, '.' or '..'): {sample.directory!r}"
    elif match is None:
        problems[Problem.BAD_LAYOUT] = f"not {{generator}}/{{task}}_task/{{task}}_NNNNNNNN/: {sample.directory!r}"
    elif not (is_text(group) and is_text(sid)):
        problems[Problem.BAD_LAYOUT] = f"a group or id that is not UTF-8 cannot name an output: {shown}"
    elif not (is_safe_name(group) and is_safe_name(sid)):  # a generator's layout: its names are safe, or damaged
        problems[Problem.BAD_LAYOUT] = f"unsafe group or id for a path: {sample.directory!r}"
    members = {name: MemberIdentity(size=m.size, mtime=m.mtime) for name, m in sample.members().items()}
    identity = SourceIdentity(members=members)
    return SampleRef(
        id=name_key(sid),
        group=name_key(group),
        key=shown,
        read_media=lambda: _read_member(tf, sample, VIDEO_MEMBER, identity, shard, max_mb, relisting),
        read_prompt=lambda: _read_member(tf, sample, PROMPT_MEMBER, identity, shard, max_mb, relisting),
        read_together=lambda: _read_together(tf, sample, identity, shard, max_mb, relisting),
        problems=problems,
        identity=identity,
        stem=f"{group}/{sid}" if group and Problem.BAD_LAYOUT not in problems else "",
        listed=sample.record(),
    )


def _read_member(
    tf: tarfile.TarFile,
    sample: _SampleMembers,
    name: str,
    identity: SourceIdentity,
    shard: Shard,
    max_mb: int,
    relisting: Relisting[_SampleMembers] | None = None,
) -> bytes | None:
    """The sample's member `name` (see `_read`), its record proven first where it was made from one (`relisting`);
    InputError ``shard_truncated`` for one that is missing from the last sample before a tar's damage (it may be
    past the cut)."""
    if relisting is not None and not sample.proven:
        check_unchanged(shard, tf)  # a tar rewritten since is that, not a record to mend
        if not relisting.check(sample, functools.partial(read_headers, stream_of(tf), shard)):
            _renote(sample, identity)
    if relisting is not None and name not in sample.members() and not sample.listed_now:
        relisting.confirm(sample, name)
        _renote(sample, identity)
    member = sample.members().get(name)
    if member is None and sample.cut:
        raise InputError("shard_truncated", f"the shard ends inside {sample.directory!r}: its {name} is not there")
    return _read(tf, f"{sample.directory}/{name}", member, identity, shard, max_mb)


def _read_together(
    tf: tarfile.TarFile,
    sample: _SampleMembers,
    identity: SourceIdentity,
    shard: Shard,
    max_mb: int,
    relisting: Relisting[_SampleMembers] | None = None,
) -> tuple[bytes | None, bytes | None]:
    """The sample's prompt and video, as `_read_member` reads each: in one range request where they lie side by side
    in a plain tar in a store (`read_side_by_side`; a record proven from the same read), else one after the
    other."""
    named = [
        (f"{sample.directory}/{PROMPT_MEMBER}", sample.prompt),
        (f"{sample.directory}/{VIDEO_MEMBER}", sample.video),
    ]
    small = sample.prompt is not None and sample.prompt.size <= MAX_PROMPT_BYTES  # else refused by `_read`, unread
    check = _checker(sample, identity, relisting)
    data = read_side_by_side(tf, shard, named, max_mb, check) if small else None
    if data is None:
        read = functools.partial(
            _read_member, tf, sample, identity=identity, shard=shard, max_mb=max_mb, relisting=relisting
        )
        return read(PROMPT_MEMBER), read(VIDEO_MEMBER)
    return _noted(*named[0], data[0], identity), _noted(*named[1], data[1], identity)  # type: ignore[arg-type]


#: Proves a record-made sample from the header bytes a read fetched (`Member` → its headers): False when the sample
#: was mended from the tar's listing instead (its members are then others: read each on its own).
Check = Callable[[Callable[[Member], bytes]], bool]


def _checker(sample: _SampleMembers, identity: SourceIdentity, relisting: Relisting[Any] | None) -> Check | None:
    """The `Check` of a sample made from a record (None for one listed from the tar, or proven already)."""
    if relisting is None or sample.proven:
        return None

    def check(headers: Callable[[Member], bytes]) -> bool:
        held = relisting.check(sample, headers)
        if not held:
            _renote(sample, identity)
        return held

    return check


def _renote(sample: _SampleMembers, identity: SourceIdentity) -> None:
    """`identity`'s members made what the (mended) `sample` lists."""
    identity.members.clear()
    identity.members.update({n: MemberIdentity(size=m.size, mtime=m.mtime) for n, m in sample.members().items()})


def read_side_by_side(
    tf: tarfile.TarFile,
    shard: Shard,
    named: list[tuple[str, Member | None]],
    max_mb: int,
    check: Check | None = None,
) -> list[bytes] | None:
    """The bytes of the members `named` (path in the tar, member) in one range request, where `tf` is a plain tar in
    a store and they lie side by side there (`tars.span`); None where they do not (a local or compressed tar, a
    member missing, sparse or far off: each is then read on its own), or where `check` (a sample made from a record:
    its headers read in the same request) mended the sample. Checked as `_read` checks one member: the shard as
    listed, each size against `max_mb`; a failed read is its InputError. Bytes cut short come back short: the
    caller's check says so."""
    stream = _plain_stream(shard, tf)
    where = span([m for _, m in named], headers=check is not None) if stream is not None else None
    if where is None:
        return None
    check_unchanged(shard, tf)
    try:
        block = read_span(stream, named, where, max_mb)  # type: ignore[arg-type]  # `span` said each is listed
    except (tarfile.TarError, OSError, EOFError) as exc:
        read_failed(shard, tf, exc)
        raise InputError("member_unreadable", f"{' + '.join(path for path, _ in named)}: {exc}") from exc
    if check is not None and not check(lambda m: cut(block, where, m.offset, m.offset_data)):
        return None
    return [cut(block, where, m.offset_data, m.offset_data + m.size) for _, m in named]  # type: ignore[union-attr]


def _plain_stream(shard: Shard, tf: tarfile.TarFile) -> IO[bytes] | None:
    """The store's stream the tar `tf` of `shard` reads, where it is a plain tar (a member's offset is its place in
    the stream: `tars.read_span` reads there); None for a local or a compressed tar."""
    return stream_of(tf) if shard.path.endswith(PLAIN_TAR) else None


def _noted(path: str, member: Member, data: bytes, identity: SourceIdentity) -> bytes:
    """`data`, the bytes read of the member at `path`, their sha256 noted in `identity`; InputError for fewer."""
    if len(data) != member.size:
        raise InputError("member_unreadable", f"{path}: {len(data)} of {member.size} bytes (shard cut short)")
    identity.read_sha256[path.rpartition("/")[2]] = hashlib.sha256(data).hexdigest()
    return data


def _read(
    tf: tarfile.TarFile, path: str, member: Member | None, identity: SourceIdentity, shard: Shard, max_mb: int
) -> bytes | None:
    """The bytes of the member at `path` (their sha256 noted in `identity`); None when missing or not a regular
    file; InputError when the shard cuts it off, vanished or changed since it was listed, for a prompt too large to
    read, or a member over `max_mb` MiB (``too_large``, nothing of it read)."""
    if member is None or not member.regular:
        return None
    check_unchanged(shard, tf)
    name = path.rpartition("/")[2]
    if name == PROMPT_MEMBER and member.size > MAX_PROMPT_BYTES:
        raise InputError("prompt_too_long", f"{path}: {member.size} bytes, over {MAX_PROMPT_BYTES}: not read")
    try:
        data = read_member(tf, path, member, max_mb)
    except (tarfile.TarError, OSError, EOFError) as exc:
        read_failed(shard, tf, exc)
        raise InputError("member_unreadable", f"{path}: {exc}") from exc
    return _noted(path, member, data, identity)


def check_unchanged(shard: Shard, tf: tarfile.TarFile | None = None) -> None:
    """InputError when the shard file is gone, or is not the file that was listed (its size or mtime differ). A tar
    `tf` opened from S3 reads the object it opened only (every range request pinned to its ETag: `read_failed` says
    what a 412 or a 404 means), so it is checked against the listing as it was opened, without a request."""
    if not shard.size and not shard.mtime_ns:
        return  # listed without a stat (an older plan): nothing to compare with
    stream = stream_of(tf) if tf is not None else None
    opened = stream.pinned() if stream is not None else None
    if opened is not None:
        changes = store.differences(store.Stat(shard.size, shard.version), opened)
        if changes:
            raise InputError(
                "shard_changed", f"{store.shown(shard.path)} changed since it was listed ({changes}): not read"
            )
        return
    if is_url(shard.path):
        _check_object(shard)
        return
    try:
        stat = Path(shard.path).stat()
    except FileNotFoundError:
        raise InputError("shard_vanished", f"{shard.path} vanished since it was listed: not read") from None
    changes = []
    if stat.st_size != shard.size:
        changes.append(f"size {shard.size} → {stat.st_size}")
    if shard.mtime_ns and stat.st_mtime_ns != shard.mtime_ns:
        changes.append(f"mtime {shard.mtime_ns / 1e9:.3f} → {stat.st_mtime_ns / 1e9:.3f}")
    if changes:
        raise InputError("shard_changed", f"{shard.path} changed since it was listed ({', '.join(changes)}): not read")


def read_failed(shard: Shard, tf: tarfile.TarFile, exc: BaseException) -> None:
    """Raise the InputError of a read of a tar pinned to the object it opened (`check_unchanged`) that failed because
    the object changed (a 412) or vanished (a 404) since; return for any other error (the caller's to say)."""
    if stream_of(tf) is None:
        return
    where = store.shown(shard.path)
    if store.expired(exc):
        raise InputError("shard_changed", f"{where} changed since it was listed: not read") from exc
    if isinstance(exc, FileNotFoundError):
        raise InputError("shard_vanished", f"{where} vanished since it was listed: not read") from exc


def _check_object(shard: Shard) -> None:
    """`check_unchanged` of a shard that is an object in a store: its size and version as listed."""
    where = store.shown(shard.path)
    try:
        changes = store.changed(shard.path, store.Stat(shard.size, shard.version))
    except FileNotFoundError:
        raise InputError("shard_vanished", f"{where} vanished since it was listed: not read") from None
    except OSError as exc:
        raise InputError("member_unreadable", f"{where}: {exc}") from exc
    if changes:
        raise InputError("shard_changed", f"{where} changed since it was listed ({changes}): not read")
