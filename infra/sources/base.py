"""The Source contract: shards of samples, each sample lazily readable.

A Source lists its shards (the unit of work, retry and resume) and yields the samples of one shard
as `SampleRef`s. Media bytes are read only when asked, so a resumed run skips done samples without
reading or decoding their video.
"""

from __future__ import annotations

import enum
import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from infra.errors import InputError, LatentforgeError, SourceError
from infra.outstore import is_url
from infra.registry import Registry
from infra.sources.identity import SourceIdentity
from infra.sources.names import SAFE_NAME as SAFE_NAME  # re-exported: where readers have long found it
from infra.sources.names import is_safe_name as is_safe_name
from infra.sources.names import sample_name

#: The ledger reason of a sample whose file is a link out of its source's root (`Problem.OUTSIDE_SOURCE`).
OUTSIDE_SOURCE = "outside_source"
#: The ledger reason of a metadata file's row that cannot be a sample (a path that is not a string, a NUL, a caption
#: that is not text, a row the parser cannot read: `infra.sources.meta_rows`).
BAD_ROW = "bad_row"
FOLLOW_FLAG = "--follow-symlinks"


def outside_root(root: Path, path: Path, *, follow_symlinks: bool = False) -> str | None:
    """Why `path` may not be read as part of the source rooted at `root`: it resolves (links followed) to a place
    outside the root, and links are not followed out of it unless the user says so (`follow_symlinks`); None when
    it may (a link inside the root is fine). A resolved path can change after this check: a source is the user's
    data, not OUT, whose door (`infra.outdir`) is race-free."""
    if follow_symlinks:
        return None
    top, real = os.path.realpath(root), os.path.realpath(path)
    if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
        return None
    return f"{path} leads to {real}, outside the source root {top}: not read ({FOLLOW_FLAG} reads it)"


def glob_root(spec: str) -> Path | None:
    """The folder a source's PATH spreads from: the folder named, or a pattern's folder before its first wildcard
    (``data/**/*.tar`` → ``data``); None for a file named (the user's own choice, a link or not)."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        fixed = itertools.takewhile(lambda part: not any(ch in part for ch in "*?["), path.parts)
        return Path(*fixed) if path.parts and not any(ch in path.parts[0] for ch in "*?[") else Path()
    return path if path.is_dir() else None


def source_place(spec: str) -> str:
    """Where the source whose PATH is `spec` lies: the folder it names or spreads from (a pattern's, a brace
    pattern's fixed folder), the file it names, or for a URL the prefix before its first wildcard; local paths made
    absolute with links resolved. What OUT must be apart from (`flows.preflight.check_apart`)."""
    cut = min((spec.index(ch) for ch in "*?[{" if ch in spec), default=None)
    if is_url(spec):
        return spec if cut is None else spec[:cut].rpartition("/")[0]
    fixed = Path(spec[:cut].rpartition("/")[0] or ".") if cut is not None else Path(spec)
    return os.path.realpath(fixed.expanduser())


def outside_source(spec: str, path: str, *, follow_symlinks: bool = False) -> str | None:
    """Why `path` (a shard's, as an earlier run recorded it: `infra.plan.recorded_shards`) is not a place of the
    source whose PATH is `spec`; None when it is: the file `spec` names, or a path below the folder it names or
    spreads from (a pattern's, a brace pattern's fixed folder) that leads nowhere else (`outside_root`); for a URL,
    an object below the URL's prefix, with no ``.`` or ``..`` segment. The containment of a source's own listing,
    for a path it did not list now."""
    if is_url(spec):
        return _outside_url(spec, path)
    cut = min((spec.index(ch) for ch in "*?[{" if ch in spec), default=None)
    named = Path(spec).expanduser()
    if cut is None and not named.is_dir():
        same = os.path.realpath(named) == os.path.realpath(Path(path).expanduser())
        return None if same else f"{path} is not {spec}, the file the source names"
    root = Path(spec[:cut].rpartition("/")[0] or ".").expanduser() if cut is not None else named
    lexical, top = os.path.normpath(Path(path).expanduser()), os.path.normpath(root)
    if lexical != top and not lexical.startswith(top.rstrip(os.sep) + os.sep):
        return f"{path} is not below {root}, the source's folder"
    return outside_root(root, Path(path), follow_symlinks=follow_symlinks)


def _outside_url(spec: str, path: str) -> str | None:
    cut = min((spec.index(ch) for ch in "*?[{" if ch in spec), default=len(spec))
    root = spec[:cut] if cut == len(spec) else spec[:cut].rpartition("/")[0]
    scheme_rest = path.split("://", 1)[1] if "://" in path else ""
    if any(part in (".", "..") for part in scheme_rest.split("/")):
        return f"{path} has a '.' or '..' segment"
    if path == root or path.startswith(root.rstrip("/") + "/"):
        return None
    return f"{path} is not below {root}, the source's prefix"


def refuse_outside(spec: str, paths: list[Path], what: str, *, follow_symlinks: bool = False) -> None:
    """SourceError naming the `paths` (shard files, found from `spec`) that lead out of its folder (`glob_root`); a
    shard is the unit of work, so one that cannot be read is refused at listing, not skipped."""
    root = glob_root(spec)
    if root is None:
        return
    outside = [why for path in paths if (why := outside_root(root, path, follow_symlinks=follow_symlinks))]
    if outside:
        raise SourceError(f"{what}: {len(outside)} file(s) outside the source root, first: {outside[0]}")


@dataclass(frozen=True)
class Shard:
    """One unit of work: usually one file of the source."""

    id: str
    path: str
    size: int = 0
    #: The file's mtime (ns) when listed; with `size`, what a reader checks before each read (0: not known).
    mtime_ns: int = 0
    #: An object in a store (`infra.sources.store`): its version as listed, checked with `size` before each read.
    version: str = ""
    #: (key, ``SHARD/KEY`` of the first) for each sample whose group and id an earlier sample of the plan has:
    #: set by the plan, so the later one is refused (``duplicate_id``) and never competes for the first's files.
    duplicates: tuple[tuple[str, str], ...] = ()
    #: (key, what it collides with) for each sample whose output name an earlier sample of another id has, up to
    #: case and Unicode normalisation (`infra.sources.names.collision_key`): refused (``name_collision``).
    collisions: tuple[tuple[str, str], ...] = ()


class Problem(enum.Enum):
    """Why a listed sample cannot be encoded, known from the listing (nothing of it is read); the value is its
    ledger row's reason. In order of precedence: a sample with several is refused for the first."""

    BAD_ROW = BAD_ROW
    BAD_LAYOUT = "bad_layout"
    OUTSIDE_SOURCE = OUTSIDE_SOURCE
    DUPLICATE_ID = "duplicate_id"
    NAME_COLLISION = "name_collision"
    SUPERSEDED = "superseded"


@dataclass(frozen=True)
class SampleProblem:
    """One problem of a sample and what the ledger row says of it."""

    kind: Problem
    detail: str

    def error(self) -> InputError:
        return InputError(self.kind.value, self.detail)


@dataclass
class SampleRef:
    """One source sample. `read_media` / `read_prompt` return None when the member is missing and raise
    InputError when it is there but cannot be read. Readable while its shard is being iterated.

    `identity` is what the sample is made from, as listed (no bytes read); a source's readers add the sha256
    of the bytes they return to ``identity.read_sha256``."""

    id: str
    group: str
    key: str
    read_media: Callable[[], bytes | None]
    read_prompt: Callable[[], bytes | None]
    extra: dict[str, str] = field(default_factory=dict)
    identity: SourceIdentity = field(default_factory=SourceIdentity)
    #: The sample's prompt and media read together (`read_prompt`'s and `read_media`'s bytes, noted the same way), in
    #: one request where the source has them side by side in a store (a plain tar's members); None: read each.
    #: A ref made from another with other readers (`dataclasses.replace`) sets it to None.
    read_together: Callable[[], tuple[bytes | None, bytes | None]] | None = None
    #: The sample's audio, where it is a file of its own (a metadata file's ``audio`` column); None: the media's.
    read_audio: Callable[[], bytes | None] | None = None
    #: The readers of the sample's other roles its LTX-2 mode needs (``reference_video``, ``video_mask``, ...: a
    #: metadata file's columns, `infra.sources.meta.ROLE_COLUMNS`), by role; each returns None when not listed.
    read_roles: dict[str, Callable[[], bytes | None]] = field(default_factory=dict)
    #: OUT-relative name of the sample's outputs without a suffix (``group/id`` for VBVR, the media path without
    #: its extension for a metadata file); "" when the sample cannot be named safely (a layout error).
    stem: str = ""
    #: A ``windows:K`` sample: the source frame its window starts at (its id, key and stem end in ``@first``);
    #: `source_key` is then the clip's key in its shard. None: the sample is the whole clip.
    window: int | None = None
    #: What the listing found wrong with the sample, each with its detail (`Problem.DUPLICATE_ID`'s: the sample
    #: met first): it is refused for the first (`problem`) before a byte of it is read.
    problems: dict[Problem, str] = field(default_factory=dict)
    #: What the listing found of the sample as a JSON value (a tar sample's member offsets): `Source.relisted`
    #: makes the same ref from it without listing the shard again; None where the source makes none.
    listed: Any = None

    @property
    def source_key(self) -> str:
        return self.key.rpartition("@")[0] if self.window is not None else self.key

    @property
    def problem(self) -> SampleProblem | None:
        """The problem the sample is refused for (the first in `Problem`'s order), or None."""
        kind = next((k for k in Problem if k in self.problems), None)
        if kind is None:
            return None
        detail = self.problems[kind]
        if kind is Problem.DUPLICATE_ID:  # named as read: a window of a clip by its own id
            detail = f"{sample_name(self.group, self.id)} is also {detail}, met first: that one is encoded"
        return SampleProblem(kind, detail)


class Source(ABC):
    """What every source kind implements: built from the PATH of ``KIND:PATH``."""

    kind: ClassVar[str]
    #: The encoding settings (`infra.config.EncodingConfig` / `CacheSpec` names) the source takes as keyword
    #: arguments (a metadata file's column names, ...); `open_source` passes those given.
    settings: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def __init__(self, path: str) -> None: ...

    @abstractmethod
    def shards(self) -> list[Shard]:
        """All shards, in a stable order."""

    @abstractmethod
    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        """The samples of one shard, in a stable order; a shard damaged part way yields what it can, then raises
        ShardReadError."""

    def relisted(self, shard: Shard, records: Iterator[Any], spot: bool = False) -> Iterator[SampleRef]:
        """The refs `samples` yielded, made again from what each was listed as (`SampleRef.listed`, in the same
        order) without listing the shard: the same keys, identities and problems, read the same way, each record
        proven where its bytes are read (`infra.sources.relist`); `spot`: a few proven first (a kept listing's).
        Only a source whose refs carry a record has it."""
        raise NotImplementedError(f"{self.kind} source: its samples are listed, not made from records")


class ShardReadError(LatentforgeError, RuntimeError):
    """A shard could not be read to its end; the samples listed before the damage were yielded first."""


SOURCES: Registry[type[Source]] = Registry("source kind", error=SourceError)


def mark_duplicate(ref: SampleRef, shard: Shard) -> SampleRef:
    """`ref`, flagged (`Problem.DUPLICATE_ID`, no output name) when the plan met its group and id earlier, or
    (`Problem.NAME_COLLISION`) another sample's output name."""
    first = dict(shard.duplicates).get(ref.key)
    if first is not None:
        ref.problems[Problem.DUPLICATE_ID] = first
        ref.stem = ""
    collides = dict(shard.collisions).get(ref.key) if shard.collisions else None
    if collides is not None:
        ref.problems[Problem.NAME_COLLISION] = collides
        ref.stem = ""
    return ref


def register_source(kind: str) -> Callable[[type[Source]], type[Source]]:
    """Class decorator: make a source kind available as ``KIND:PATH``."""

    def wrap(cls: type[Source]) -> type[Source]:
        cls.kind = kind
        return SOURCES.add(kind, cls)

    return wrap


def open_source(spec: str, *settings: object) -> Source:
    """Build a Source from ``KIND:PATH``; `settings` (an `EncodingConfig` or a `CacheSpec`: the same names; a
    `LimitsConfig` for the readers' cap) give the source kind the settings it takes (`Source.settings`), each from
    the first that has it not None. A setting none gives keeps the source's default (``max_media_mb``: its cap,
    `infra.sources.bounded.DEFAULT_MAX_MEDIA_MB`, so every reader is bounded)."""
    kind, _, path = spec.partition(":")
    cls = SOURCES.get(kind)
    given = {name: [v for s in settings if (v := getattr(s, name, None)) is not None] for name in cls.settings}
    return cls(path, **{name: values[0] for name, values in given.items() if values})
