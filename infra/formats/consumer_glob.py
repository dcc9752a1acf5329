"""What a format's consumer loads from OUT, by its own glob: the files a trainer pointed at OUT would read.

A `ConsumerGlob` is the patterns a consumer's loader walks OUT with (OUT-relative, ``/`` between names): ``*`` and
``?`` within one name, ``**`` any run of folders (none included), every other character as itself. `hidden` says
whether a ``*`` matches a name that starts with ``.``: Python's `glob.glob` (musubi-tuner's) skips such names,
`pathlib.Path.glob`, `os.walk` and `os.listdir` (LTX-2's trainer, FastVideo, DiffSynth-Studio) do not.

`files` lists the files of OUT the patterns match, walking only the folders a pattern can reach (a musubi cache: its
top folder; an LTX-2 one: ``.precomputed``'s), through the door (`infra.outdir`): a link is never followed, and one
a consumer would follow (a file link the patterns match, a folder link inside their reach) is returned apart, as a
link. In a store one listing of OUT gives every object below it (a store has no links).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from infra import outdir
from infra.outstore import StoreOut


@dataclass(frozen=True)
class Found:
    """The files of OUT a consumer loads (OUT-relative, sorted), and the links among the names it reaches."""

    files: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ConsumerGlob:
    """A consumer's own glob over OUT (see the module)."""

    patterns: tuple[str, ...]
    hidden: bool = True

    @cached_property
    def _compiled(self) -> tuple[tuple[re.Pattern[str] | None, ...], ...]:
        return tuple(tuple(None if seg == "**" else self._segment(seg) for seg in p.split("/")) for p in self.patterns)

    def _segment(self, seg: str) -> re.Pattern[str]:
        body = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in seg)
        lead = "" if self.hidden or seg.startswith(".") else r"(?!\.)"
        return re.compile(lead + body)

    def loads(self, rel: str) -> bool:
        """Whether the consumer loads the file at OUT-relative `rel`."""
        names = tuple(rel.split("/"))
        return any(_match(p, names, whole=True, hidden=self.hidden) for p in self._compiled)

    def reaches(self, folder: str) -> bool:
        """Whether a pattern can match a file below the OUT-relative `folder` ("" is OUT itself)."""
        names = tuple(folder.split("/")) if folder else ()
        return any(_match(p, names, whole=False, hidden=self.hidden) for p in self._compiled)

    def files(self, out: outdir.Out) -> Found:
        """The files of OUT the consumer loads, and the links it would follow (see the module)."""
        root = outdir.root(out)
        if isinstance(root, StoreOut):
            return Found(sorted(rel for rel in root.find("") if self.loads(rel)))
        files: list[str] = []
        links: list[str] = []
        folders = [""]
        while folders:
            folder = folders.pop()
            for entry in outdir.entries(root, folder):
                rel = f"{folder}/{entry.name}" if folder else entry.name
                if entry.kind == "dir" and self.reaches(rel):
                    folders.append(rel)
                elif entry.kind == "file" and self.loads(rel):
                    files.append(rel)
                elif entry.kind == "link" and (self.loads(rel) or self.reaches(rel)):
                    links.append(rel)
        return Found(sorted(files), sorted(links))


def _match(segs: tuple[re.Pattern[str] | None, ...], names: tuple[str, ...], *, whole: bool, hidden: bool) -> bool:
    """Whether `names` match all of `segs` (`whole`), or are a folder some match of `segs` passes through."""
    if not names:
        return not segs if whole else bool(segs)
    if not segs:
        return False
    head, rest = segs[0], segs[1:]
    if head is None:  # ``**``: no folder, or this one and maybe more
        deeper = (hidden or not names[0].startswith(".")) and _match(segs, names[1:], whole=whole, hidden=hidden)
        return _match(rest, names, whole=whole, hidden=hidden) or deeper
    return bool(head.fullmatch(names[0])) and _match(rest, names[1:], whole=whole, hidden=hidden)
