"""The rows of a metadata file (``.csv``, ``.json``, ``.jsonl``), each read and checked on its own.

A row that cannot be a sample is a `Row` with a `problem`, which the source makes that sample's ``bad_row`` ledger
row: every other row is still planned and built. A row is bad when it is not an object, when it lists no media path,
when a path column (video, audio, a role's) is not a string, holds a NUL, is longer than a path can be or is not a
file name, when its caption is not text (FastVideo's list: its first entry), when it is a jsonl line or a .json
element that is not JSON or nests deeper than the JSON parser goes, or a CSV record the csv module refuses (a field
over its 128 KiB limit). Bytes that are not UTF-8 are kept as lone surrogates (``surrogateescape``): a caption
holding them is its sample's ``prompt_not_utf8`` row, a media path its ``bad_layout`` row, as for a file name of a
folder source.

What cannot be told apart into rows is one `SourceError` naming the file: a CSV header the csv module refuses, a
.json that is not a list or whose syntax breaks between elements.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from infra.errors import SourceError

#: The longest path a row may list, in bytes (Linux's PATH_MAX).
MAX_PATH_BYTES = 4096
_BLANK = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Row:
    """One listed sample: its media path as written, the caption (None: no caption), the audio path, the paths of
    its other roles as written, and why it cannot be a sample (None: it can)."""

    index: int
    media: str
    caption: str | None
    audio: str | None
    roles: tuple[tuple[str, str], ...] = ()
    problem: str | None = None


@dataclass(frozen=True)
class Unreadable:
    """A row the file's parser could not read (the entry in the place of its object)."""

    why: str


def decode(data: bytes) -> str:
    """The file's text: UTF-8 (a byte-order mark dropped), a byte that is not UTF-8 kept as a lone surrogate."""
    return data.decode("utf-8-sig", "surrogateescape")


def entries(text: str, suffix: str, path: str) -> tuple[list[Any], set[str] | None]:
    """The file's rows (an object, or `Unreadable`) and, for a CSV, its columns."""
    if suffix == ".csv":
        return _csv(text, path)
    return (_json(text, path) if suffix == ".json" else _jsonl(text)), None


def _csv(text: str, path: str) -> tuple[list[Any], set[str]]:
    reader = csv.DictReader(io.StringIO(text))
    try:
        columns = set(reader.fieldnames or [])
    except csv.Error as exc:
        raise SourceError(f"{path}: the CSV header cannot be read ({exc})") from exc
    found: list[Any] = []
    while True:
        try:
            found.append(next(reader))
        except StopIteration:
            return found, columns
        except csv.Error as exc:  # the reader goes on at the next record
            found.append(Unreadable(f"not a CSV record the csv module reads ({exc})"))


def _jsonl(text: str) -> list[Any]:
    # lines split at "\n" only: str.splitlines would split inside a JSON string at U+2028 and its kin
    return [_loads(line) for line in text.split("\n") if line.strip()]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (RecursionError, ValueError) as exc:
        return _unreadable(exc)


def _unreadable(exc: Exception) -> Unreadable:
    if isinstance(exc, RecursionError):
        return Unreadable("nested deeper than the JSON parser goes")
    return Unreadable(f"not JSON ({str(exc)[:200]})")


def _json(text: str, path: str) -> list[Any]:
    """The elements of a top-level JSON list, decoded one by one, so that one too deep is that row's problem."""
    decoder, pos = json.JSONDecoder(), _BLANK.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("[", pos):
        raise SourceError(f"{path}: a .json metadata file holds a list of objects")
    found: list[Any] = []
    pos = _BLANK.match(text, pos + 1).end()  # type: ignore[union-attr]
    while not (found == [] and text.startswith("]", pos)):
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}: not JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
        except (RecursionError, ValueError) as exc:  # too deep; an integer over Python's 4300 digits
            entry, pos = _unreadable(exc), _skip_value(text, pos, path)
        found.append(entry)
        pos = _BLANK.match(text, pos).end()  # type: ignore[union-attr]
        if not text.startswith(",", pos):
            break
        pos = _BLANK.match(text, pos + 1).end()  # type: ignore[union-attr]
    if not text.startswith("]", pos) or _BLANK.match(text, pos + 1).end() != len(text):  # type: ignore[union-attr]
        line = text.count("\n", 0, pos) + 1
        raise SourceError(f"{path}: not JSON at line {line}: expected ',' or ']' after row {len(found)}")
    return found


def _skip_value(text: str, pos: int, path: str) -> int:
    """Where the element at `pos` ends (the ``,`` or ``]`` after it), found without recursion, strings and their
    escapes skipped: for an element the decoder gave up on (nested too deep, an integer of too many digits)."""
    depth, inside, escaped = 0, False, False
    for i in range(pos, len(text)):
        char = text[i]
        if inside:
            escaped, inside = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            inside = True
        elif char in "[{":
            depth += 1
        elif char in "]}" and depth > 0:
            depth -= 1
        elif char in ",]" and depth == 0:
            return i
    raise SourceError(f"{path}: not JSON: the row at offset {pos} never ends")


def make_row(index: int, entry: Any, columns: tuple[tuple[str, ...], tuple[str, ...]], roles: dict) -> Row:
    """`entry` as a Row; a Row with its `problem` when it cannot be a sample."""
    if isinstance(entry, Unreadable):
        return Row(index, "", None, None, problem=entry.why)
    if not isinstance(entry, dict):
        return Row(index, "", None, None, problem=f"an object with a video and a caption, not {_kind(entry)}")
    media, problem = path_column(entry, columns[0], "video")
    audio, audio_problem = path_column(entry, ("audio",), "audio")
    caption, caption_problem = _caption(entry, columns[1])
    listed, role_problems = [], []
    for role, names in roles.items():
        value, why = path_column(entry, names, role)
        role_problems.append(why)
        if value is not None:
            listed.append((role, value))
    if media is None and problem is None:
        problem = f"no media path (column {' or '.join(columns[0])})"
    problem = next((p for p in (problem, audio_problem, caption_problem, *role_problems) if p), None)
    return Row(index, media or "", caption, audio, tuple(listed), problem)


def first(entry: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The first of the columns `names` with a value (not null, not empty)."""
    return next((entry[name] for name in names if name in entry and entry[name] not in (None, "")), None)


def path_column(entry: dict[str, Any], names: tuple[str, ...], what: str) -> tuple[str | None, str | None]:
    """(the path the columns `names` list, stripped; None: none), (why it cannot be a path; None: it can)."""
    value = first(entry, names)
    if value is None:
        return None, None
    if not isinstance(value, str):
        return None, f"the {what} path is {_kind(value)}, not a string"
    if "\0" in value:
        return None, f"the {what} path holds a NUL character"
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        return None, f"the {what} path has {size} bytes, over {MAX_PATH_BYTES} (PATH_MAX)"
    try:
        os.fsencode(value)
    except UnicodeEncodeError:
        return None, f"the {what} path holds a lone surrogate that is no byte of a file name: {value[:80]!r}"
    return value.strip(), None


def _caption(entry: dict[str, Any], names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(the caption: the first caption column with a value, ``""`` when the only ones there are empty; FastVideo's
    list: its first entry), (why it is not text; None: it is)."""
    found = first(entry, names)
    if found is None and any(entry.get(name) == "" for name in names):
        return "", None
    what = "the caption"
    if isinstance(found, list):  # FastVideo: several captions; the first is the sample's
        found, what = (found[0] if found else None), "the caption list's first entry"
    if found is None or isinstance(found, str):
        return found, None
    return None, f"{what} is {_kind(found)}, not text"


_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}


def _kind(value: Any) -> str:
    if type(value) in _KINDS:
        return _KINDS[type(value)]
    return f"a number ({repr(value)[:40]})" if isinstance(value, int | float) else type(value).__name__
