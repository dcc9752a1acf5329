"""Reports under ``OUT/reports/``: the naming rule every report shares, and tables rendered as markdown or text.

A report is named ``<kind>-<UTC YYYYmmddTHHMMSSZ>[-N].<ext>`` and never overwritten: when a name is taken
(two reports in the same second), the next free ``-2``, ``-3``, ... is used, and the files go through
`atomic_write` without ``replace``, so even a racing writer cannot clobber one. "Newest" orders by the
timestamp, then by that number (``-10`` after ``-9``, and the unnumbered name first).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import astuple, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from infra import outdir
from infra.storage import atomic_write

logger = logging.getLogger("infra.reports")  # its name before the rename: the same log lines

REPORTS_DIR = "reports"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
#: Report prefixes that are not part of the cache: each upload writes one, so publishing them would make
#: every upload send something new.
UNPUBLISHED_REPORTS = ("upload-",)
_NAME = re.compile(r"^(?P<prefix>[a-z]+)-(?P<stamp>\d{8}T\d{6}Z)(?:-(?P<n>[1-9]\d*))?$")
#: Folders of reports (decode-and-verify's strips and reports, `infra.audit.decode_verify`), named by no stamp.
DECODE_DIR = "decode"


def human_bytes(n: float) -> str:
    """1234567 → '1.2 MB' (decimal units)."""
    unit = 0
    while abs(n) >= 1000 and unit < 5:
        n, unit = n / 1000, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {'KMGTP'[unit - 1]}B"


def reports_dir(out: Path) -> Path:
    """``OUT/reports``."""
    return Path(out) / REPORTS_DIR


def utc_stamp(now: datetime | None = None) -> str:
    """A UTC timestamp for a report name: ``YYYYmmddTHHMMSSZ``."""
    return (now or datetime.now(UTC)).astimezone(UTC).strftime(STAMP_FORMAT)


def report_order(path: Path, prefix: str) -> tuple[str, int] | None:
    """Sort key of a report file named by `write_new` with `prefix`; None for any other name."""
    match = _NAME.fullmatch(path.name.split(".", 1)[0])
    if match is None or match["prefix"] != prefix:
        return None
    return match["stamp"], int(match["n"] or 1)


def written_here(rel: str) -> bool:
    """Whether a path below ``OUT/reports`` is one latentforge writes: a stamped report (`write_new`) or a file of
    decode-and-verify's folder; anything else there was put by someone else and is not part of the cache."""
    head, _, rest = rel.partition("/")
    return bool(rest) if head == DECODE_DIR else not rest and _NAME.fullmatch(head.split(".", 1)[0]) is not None


def write_new(
    directory: Path | str, prefix: str, files: Mapping[str, bytes], *, stamp: str | None = None, out: Path | None = None
) -> list[Path]:
    """Write ``<prefix>-<stamp>[-N]<suffix>`` for each suffix → bytes in `files`, with the first N at which
    none of the names exists; never overwrites. Returns the paths in the order of `files`. With `out`, `directory`
    is OUT-relative and every name goes through the door (`infra.outdir`: no link followed)."""
    stamp = stamp or utc_stamp()
    for n in itertools.count(1):
        stem = f"{prefix}-{stamp}" if n == 1 else f"{prefix}-{stamp}-{n}"
        names = [f"{Path(directory).as_posix()}/{stem}{suffix}" for suffix in files]
        if any(_taken(name, out) for name in names):
            continue
        written: list[Path] = []
        try:
            for name, data in zip(names, files.values(), strict=True):
                written.append(atomic_write(name, data, out=out).path)
        except FileExistsError:  # a racing writer took a name after the check: drop our part, try the next N
            for name in names[: len(written)]:
                if out is not None:
                    outdir.unlink(out, name)
                else:
                    Path(name).unlink(missing_ok=True)
            continue
        logger.info("wrote %s", ", ".join(str(p) for p in written))
        return written
    raise AssertionError("unreachable")  # pragma: no cover


def _taken(name: str, out: Path | None) -> bool:
    return outdir.lstat(out, name) is not None if out is not None else Path(name).exists()


def shorten(text: str, limit: int = 48) -> str:
    """`text`, or its head and tail around a "…" when longer than `limit` (the tail names the file)."""
    if len(text) <= limit:
        return text
    tail = limit * 2 // 3
    return f"{text[: limit - tail - 1]}…{text[-tail:]}"


#: Widths tried, largest first, when a picture is embedded in an artifact: the first whose PNG fits its share.
EMBED_WIDTHS = (640, 480, 360, 240, 160, 120)
#: A smaller picture (a tiny test geometry's strip) is first tried enlarged by a whole factor to at least this
#: width, pixels repeated (nearest), so it can be seen; PNG stores the repeats for little.
MIN_SHOWN_WIDTH = 360
MAX_SHOWN_HEIGHT = 400  # ... unless that makes it taller than this (a short clip's mel picture)
_LANCZOS = Image.Resampling.LANCZOS


class Embedded(NamedTuple):
    """A picture made small enough to embed: its data URI, its width, and whether it was cut to 256 colours."""

    uri: str
    width: int
    palette: bool


def png_data_uri(png: bytes, max_chars: int, widths: tuple[int, ...] = EMBED_WIDTHS) -> Embedded | None:
    """A PNG as a ``data:image/png;base64,...`` URI of at most `max_chars` characters: at the largest of `widths`
    that fits (never enlarged, except a small one first tried at `MIN_SHOWN_WIDTH`, at most `MAX_SHOWN_HEIGHT`
    tall), in full colour, else at that width in 256 colours (a 480-wide strip of 832² frames: 464 KB in full
    colour, 139 KB in 256), else smaller. None when even the smallest does not fit."""
    with Image.open(io.BytesIO(png)) as image:
        picture = image.convert("RGB")
    if picture.width > widths[0]:  # one resize from full size; the smaller candidates are made from this one
        picture = picture.resize((widths[0], max(1, round(picture.height * widths[0] / picture.width))), _LANCZOS)
    sizes = []
    k = min(-(-MIN_SHOWN_WIDTH // picture.width), MAX_SHOWN_HEIGHT // picture.height)
    if k > 1:
        sizes.append((picture.width * k, picture.height * k))
    for width in (min(w, picture.width) for w in widths):
        sizes.append((width, max(1, round(picture.height * width / picture.width))))
    for size in dict.fromkeys(sizes):  # in order, once each
        filt = Image.Resampling.NEAREST if size[0] > picture.width else _LANCZOS
        scaled = picture if size == picture.size else picture.resize(size, filt)
        for palette in (False, True):
            shown = scaled.quantize(256, Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE) if palette else scaled
            buffer = io.BytesIO()
            shown.save(buffer, format="PNG", compress_level=6)
            uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
            if len(uri) <= max_chars:
                return Embedded(uri, size[0], palette)
            if not palette and len(uri) > 4 * max_chars:  # 256 colours save ~2-3x, not 4x: skip to a smaller size
                break
    return None


#: A report section: (title, column names, rows of cells). Tables render the same in markdown and a terminal.
Section = tuple[str, list[str], list[list[Any]]]


def _cell(value: Any, *, markdown: bool = True) -> str:
    text = "—" if value is None or value == "" else " ".join(str(value).split())
    return text.replace("|", "\\|") if markdown else text


def dataclass_rows(kind: type, items: list[Any]) -> tuple[list[str], list[list[Any]]]:
    """A list of dataclass instances as (column names, rows) for a section."""
    return [f.name for f in fields(kind)], [list(astuple(item)) for item in items]


def shown(items: list[Any], limit: int | None) -> str:
    """``"N"``, or ``"first LIMIT of N"`` when a listing is cut at `limit`."""
    return f"first {limit} of {len(items)}" if limit is not None and len(items) > limit else str(len(items))


def render_markdown(title: str, intro: list[str], sections: list[Section]) -> str:
    """``## title``, intro lines, then one table per section (a section with no rows is left out)."""
    lines = [f"## {title}", "", *(f"* {_cell(line)}" for line in intro)]
    for name, header, rows in sections:
        if rows:
            lines += ["", f"### {name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_text(title: str, intro: list[str], sections: list[Section]) -> str:
    """The same for a terminal: aligned columns."""
    lines = [title, *(f"  {line}" for line in intro)]
    for name, header, rows in sections:
        if rows:
            table = [header, *([_cell(c, markdown=False) for c in row] for row in rows)]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines += ["", f"{name}:"]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines) + "\n"


def to_json_bytes(data: Mapping[str, Any]) -> bytes:
    """Sorted keys, indented, UTF-8; paths and times as strings."""
    return (json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n").encode()
