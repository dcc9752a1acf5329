"""WebDataset tar shards, ``wds:PATH``: a tar, a directory of tars, or a brace pattern (``dir/{000..009}.tar``,
``dir/{a,b}.tar``; globs too).

A sample is the members sharing a key (the member path up to the first ``.`` of its file name, as webdataset
splits it): ``<key>.{jpg,jpeg,png,webp}`` (the image), ``<key>.txt`` (the caption), optional ``<key>.json``
(recorded in the sample's identity, not read). One shard per tar; group = the shard id; id = the key; outputs
``<shard>/<key>`` (each name made safe: `infra.sources.names.output_part`; a key that is not UTF-8 is a
``bad_layout`` row). Members are streamed from the tar like VBVR's (`infra.sources.vbvr`): listing reads headers
only, a done sample's bytes are never read on resume, and the tar is checked against its listing before each read.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import logging
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.errors import InputError, SourceError
from infra.media.image import IMAGE_SUFFIXES
from infra.media.prompts import MAX_PROMPT_BYTES
from infra.outstore import is_url
from infra.sources import store
from infra.sources.base import (
    Problem,
    SampleRef,
    Shard,
    ShardReadError,
    Source,
    mark_duplicate,
    refuse_outside,
    register_source,
)
from infra.sources.bounded import DEFAULT_MAX_MEDIA_MB
from infra.sources.identity import MemberIdentity, SourceIdentity
from infra.sources.names import name_key, nameable, output_stem
from infra.sources.relist import Relisting, made, read_headers
from infra.sources.tars import BadRecord, Member, TarDamaged, from_record, read_member, record, scan, short, stream_of
from infra.sources.vbvr import (
    TAR_SUFFIXES,
    Check,
    check_unchanged,
    find_store_tars,
    open_shard_tar,
    read_failed,
    read_side_by_side,
    tar_shards,
)

logger = logging.getLogger(__name__)

CAPTION_EXT, META_EXT = "txt", "json"
IMAGE_EXTS = tuple(s.lstrip(".") for s in IMAGE_SUFFIXES)
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_BRACES = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``a{000..002}b`` → a000b a001b a002b (zero padding kept); ``{x,y}`` → both; nested left to right."""
    found = [m for m in (_RANGE.search(pattern), _BRACES.search(pattern)) if m is not None]
    if not found:
        return [pattern]
    match = min(found, key=lambda m: (m.start(), m.re is not _RANGE))
    head, tail = pattern[: match.start()], pattern[match.end() :]
    if match.re is _RANGE:
        lo, hi = match.group(1), match.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        options = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    else:
        options = match.group(1).split(",")
    return list(itertools.chain.from_iterable(expand_braces(head + o + tail) for o in options))


def find_store_tars_in(spec: str) -> dict[str, store.Stat]:
    """The tars a URL with brace patterns names, by URL as listed, sorted; SourceError when it names nothing."""
    found: dict[str, store.Stat] = {}
    for part in expand_braces(spec):
        listed = find_store_tars(part, "wds")
        if not listed and "{" in spec:
            raise SourceError(f"wds source {store.shown(spec)!r}: {store.shown(part)} does not exist")
        found |= listed
    if not found:
        raise SourceError(f"wds source {store.shown(spec)!r}: no tar shards found ({', '.join(TAR_SUFFIXES)})")
    return dict(sorted(found.items()))


def find_tars(spec: str, follow_symlinks: bool = False) -> list[Path] | dict[str, store.Stat]:
    """The tars `spec` names, sorted; SourceError when it names nothing, or a tar that is a link out of the folder a
    part of it names (unless `follow_symlinks`). A URL: the objects it names, as listed (`infra.sources.store`)."""
    if is_url(spec):
        return find_store_tars_in(spec)
    found: list[Path] = []
    for part in expand_braces(spec):
        path = Path(part).expanduser()
        if any(ch in part for ch in "*?["):
            listed = [Path(p) for p in glob.glob(str(path), recursive=True)]
        elif path.is_dir():
            listed = [p for p in path.rglob("*") if p.is_file()]
        elif path.is_file():
            listed = [path]
        elif "{" in spec:
            raise SourceError(f"wds source {spec!r}: {part} does not exist")
        else:
            listed = []
        refuse_outside(part, listed, f"wds source {spec!r}", follow_symlinks=follow_symlinks)
        found += listed
    tars = sorted({p for p in found if p.name.endswith(TAR_SUFFIXES)})
    if not tars:
        raise SourceError(f"wds source {spec!r}: no tar shards found ({', '.join(TAR_SUFFIXES)})")
    return tars


@dataclass(slots=True)
class _Sample:
    key: str
    #: (extension, member record) in tar order, the first of each extension (a tuple: a dict per sample is ~4×)
    members: tuple[tuple[str, Member], ...] = ()
    proven: bool = True  # listed from the tar's headers; made from a record: proven where it is read (`relist`)
    listed_now: bool = True  # listed from the tar's headers (not made from a record)

    @property
    def name(self) -> str:
        return self.key

    def member(self, ext: str) -> Member | None:
        return next((m for e, m in self.members if e == ext), None)

    def checks(self) -> list[tuple[Member, Callable[[str], bool]]]:
        """Each member, with what accepts its header's name (`relist.Recorded`)."""
        return [(m, functools.partial(_is_member, (self.key, ext))) for ext, m in self.members]

    def adopt(self, found: _Sample) -> None:
        self.members = found.members

    def record(self) -> list[Any]:
        """What it was listed as, a JSON value (`SampleRef.listed`)."""
        return [self.key, [[ext, record(m)] for ext, m in self.members]]

    @classmethod
    def from_record(cls, value: Any, tar_size: int = 0) -> _Sample:
        """The sample `record` made `value` from, not yet proven; BadRecord for another shape."""
        shape = f"a sample record is [key, [[extension, member], ...]], not {str(value)[:120]}"
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
            raise BadRecord(shape)
        key, members = value
        if not isinstance(members, list) or not all(
            isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and m[1] is not None for m in members
        ):
            raise BadRecord(shape)
        made = tuple((short(ext), from_record(m, tar_size)) for ext, m in members)
        return cls(key, made, proven=False, listed_now=False)  # type: ignore[arg-type]  # a member record is never None


def _is_member(key_ext: tuple[str, str], name: str) -> bool:
    """Whether a header's `name` is the member of key and extension `key_ext` (webdataset's split of it)."""
    return split_key(name) == key_ext


def split_key(name: str) -> tuple[str, str]:
    """webdataset's split of a member path: (key, extension), the extension from the file name's first dot."""
    directory, _, base = name.removeprefix("./").rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


@register_source("wds")
class WdsSource(Source):
    """WebDataset tars of images and captions (CC12M's layout)."""

    settings = ("follow_symlinks", "max_media_mb")

    def __init__(self, path: str, follow_symlinks: bool = False, max_media_mb: int = DEFAULT_MAX_MEDIA_MB) -> None:
        self.path = path
        self.follow_symlinks = follow_symlinks  # a shard file that is a link out of the source's folder: listed
        self.max_media_mb = max_media_mb  # a member over it (a sparse one at its expanded size): skipped too_large

    def shards(self) -> list[Shard]:
        return tar_shards(find_tars(self.path, self.follow_symlinks))

    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        """The shard's samples in tar order; ShardReadError at the end for a damaged tar."""
        with open_shard_tar(shard) as tf:
            samples, error = _list(tf)
            for sample in samples:
                yield mark_duplicate(_to_ref(tf, sample, shard, self.max_media_mb), shard)
        if error is not None:
            raise ShardReadError(f"{shard.path}: {error} (listed {len(samples)} samples before it)")

    def relisted(self, shard: Shard, records: Iterator[Any], spot: bool = False) -> Iterator[SampleRef]:
        """The samples as `samples` listed them (their records, in order), the tar opened but its headers not
        read (`infra.preprocess.kept`); each record proven where its bytes are read (`infra.sources.relist`)."""
        relisting: Relisting[_Sample] = Relisting(shard, _list, open_shard_tar)
        with open_shard_tar(shard) as tf:
            for sample in made(relisting, records, _Sample.from_record, tf, spot):
                yield mark_duplicate(_to_ref(tf, sample, shard, self.max_media_mb, relisting), shard)


def _list(tf: tarfile.TarFile) -> tuple[list[_Sample], str | None]:
    """Regular members grouped by key, in first-seen order (headers only, kept as `tars.Member` records: no member's
    bytes are read); the damage that stopped the listing, or None."""
    by_key: dict[str, _Sample] = {}
    error = None
    try:
        for name, member in scan(tf):
            if member.regular:
                key, ext = split_key(name)
                sample = by_key.setdefault(key, _Sample(key))
                if sample.member(ext) is None:
                    sample.members += ((short(ext), member),)
    except TarDamaged as exc:
        error = str(exc)
    return list(by_key.values()), error


def _layout_error(sample: _Sample) -> str | None:
    parts = sample.key.split("/")
    if not all(nameable(p) for p in parts):  # "..", "", or not UTF-8; any other name is made safe (`output_stem`)
        return f"unsafe key for a path: {name_key(sample.key)}"
    images = [ext for ext, _ in sample.members if ext in IMAGE_EXTS]
    if len(images) > 1:
        return f"{sample.key!r} has {len(images)} images ({', '.join(images)}): one expected"
    return None


def _to_ref(
    tf: tarfile.TarFile, sample: _Sample, shard: Shard, max_mb: int, relisting: Relisting[_Sample] | None = None
) -> SampleRef:
    error = _layout_error(sample)
    problems = {Problem.BAD_LAYOUT: error} if error else {}
    key = name_key(sample.key)
    identity = SourceIdentity(
        members={f"{key}.{ext}": MemberIdentity(size=m.size, mtime=m.mtime) for ext, m in sample.members}
    )
    read = functools.partial(_read, tf, sample, identity=identity, shard=shard, max_mb=max_mb, relisting=relisting)
    return SampleRef(
        id=key,
        group=shard.id,
        key=key,
        read_media=lambda: read(_image_of(sample)),
        read_prompt=lambda: read(CAPTION_EXT, cap=MAX_PROMPT_BYTES),
        read_together=lambda: _read_together(tf, sample, _image_of(sample), identity, shard, max_mb, relisting),
        problems=problems,
        identity=identity,
        stem="" if error else output_stem((shard.id, *sample.key.split("/"))),
        listed=sample.record(),
    )


def _image_of(sample: _Sample) -> str | None:
    """The extension of the sample's image (the first of `IMAGE_EXTS` it has), as it is now (a mended sample's)."""
    return next((e for e in IMAGE_EXTS if sample.member(e) is not None), None)


def _read_together(
    tf: tarfile.TarFile,
    sample: _Sample,
    image: str | None,
    identity: SourceIdentity,
    shard: Shard,
    max_mb: int,
    relisting: Relisting[_Sample] | None = None,
) -> tuple[bytes | None, bytes | None]:
    """The sample's caption and image, as `_read` reads each: in one range request where they lie side by side in a
    plain tar in a store (`vbvr.read_side_by_side`; a record proven from the same read), else one after the
    other."""
    caption, media = sample.member(CAPTION_EXT), sample.member(image) if image is not None else None
    named = [(f"{sample.key}.{CAPTION_EXT}", caption), (f"{sample.key}.{image}", media)]
    small = caption is not None and caption.size <= MAX_PROMPT_BYTES  # else refused by `_read`, unread
    check = _checker(sample, identity, relisting)
    data = read_side_by_side(tf, shard, named, max_mb, check) if small and image is not None else None
    if data is None:
        read = functools.partial(_read, tf, sample, identity=identity, shard=shard, max_mb=max_mb, relisting=relisting)
        image = _image_of(sample)  # a mended sample's own
        return read(CAPTION_EXT, cap=MAX_PROMPT_BYTES), read(image)
    return (
        _noted(sample, CAPTION_EXT, caption, data[0], identity),  # type: ignore[arg-type]  # listed: data is not None
        _noted(sample, image, media, data[1], identity),  # type: ignore[arg-type]
    )


def _noted(sample: _Sample, ext: str, member: Member, data: bytes, identity: SourceIdentity) -> bytes:
    """`data`, the bytes read of the sample's member `ext`, their sha256 noted in `identity`; InputError for fewer."""
    if len(data) != member.size:
        raise InputError(
            "member_unreadable", f"{sample.key}.{ext}: not all of its {member.size} bytes (shard cut short)"
        )
    identity.read_sha256[f"{name_key(sample.key)}.{ext}"] = hashlib.sha256(data).hexdigest()
    return data


def _checker(sample: _Sample, identity: SourceIdentity, relisting: Relisting[_Sample] | None) -> Check | None:
    """The `vbvr.Check` of a sample made from a record (None for one listed from the tar, or proven already)."""
    if relisting is None or sample.proven:
        return None

    def check(headers: Callable[[Member], bytes]) -> bool:
        held = relisting.check(sample, headers)
        if not held:
            _renote(sample, identity)
        return held

    return check


def _renote(sample: _Sample, identity: SourceIdentity) -> None:
    """`identity`'s members made what the (mended) `sample` lists."""
    key = name_key(sample.key)
    identity.members.clear()
    identity.members.update({f"{key}.{e}": MemberIdentity(size=m.size, mtime=m.mtime) for e, m in sample.members})


def _read(
    tf: tarfile.TarFile,
    sample: _Sample,
    ext: str | None,
    *,
    identity: SourceIdentity,
    shard: Shard,
    max_mb: int,
    cap: int | None = None,
    relisting: Relisting[_Sample] | None = None,
) -> bytes | None:
    """The bytes of the sample's member `ext` (their sha256 noted in `identity`), None when absent, its record proven
    first where it was made from one (`relisting`); InputError for a prompt over `cap`, a member over `max_mb` MiB
    (``too_large``, nothing of it read), one cut short, or a shard changed since it was listed."""
    if relisting is not None and not sample.proven:
        check_unchanged(shard, tf)  # a tar rewritten since is that, not a record to mend
        if not relisting.check(sample, functools.partial(read_headers, stream_of(tf), shard)):
            _renote(sample, identity)
    if relisting is not None and (ext is None or sample.member(ext) is None) and not sample.listed_now:
        relisting.confirm(sample, f".{ext}" if ext else "image")
        _renote(sample, identity)
        ext = _image_of(sample) if ext is None or ext in IMAGE_EXTS else ext
    member = sample.member(ext) if ext is not None else None
    if member is None:
        return None
    name = f"{sample.key}.{ext}"
    check_unchanged(shard, tf)
    if cap is not None and member.size > cap:
        raise InputError("prompt_too_long", f"{name}: {member.size} bytes, over {cap}: not read")
    try:
        data = read_member(tf, name, member, max_mb)
    except (tarfile.TarError, OSError, EOFError) as exc:
        read_failed(shard, tf, exc)
        raise InputError("member_unreadable", f"{name}: {exc}") from exc
    return _noted(sample, ext, member, data, identity)
