"""Records latentforge wrote and reads back, parsed bounded (DESIGN, invariant 10: nothing read back is trusted).

Every record latentforge writes and later reads (a listing, the recorded plan, a ledger or journal line, a lease, a
server record, cache.json, a report) is parsed here: bounded in size before a byte is parsed, bounded in nesting
(Python's parser ends in a RecursionError on a few thousand ``[``, whose traceback names no file), and a failure is
one `DamagedRecord` line that names the file, what it should have held, and the command that repairs it. What the
record's caller then does is its own: prove it against what it describes, or treat it as absent and rebuild it.

Two rules, chosen per record by what it describes:

* a record of something that can be made again (the recorded plan, a server record, a shard part's record, a
  report) is **treated as absent**: its caller makes it again, with one warning line (`warn`) that names the file;
* a record that is the truth of what was done (a ledger, a journal part, cache.json, a lease that may be live) is
  **damage**: one error line naming the file and what repairs it; nothing is rebuilt over it on a guess.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from infra.errors import LedgerError

logger = logging.getLogger(__name__)

#: The deepest nesting any record of latentforge's has (a ledger row's extra holds small dicts of lists): far more is
#: not ours, and is refused before it reaches a validator or a serializer that recurses.
MAX_DEPTH = 32
#: The largest single record (a JSON document or one JSON line) read back: a ledger line is ~1 KiB, cache.json and a
#: report a few KiB, a plan index ~200 bytes a shard (5 MiB: 25,000 shards).
MAX_RECORD_BYTES = 64 * 1024 * 1024
#: The largest small record (a lease, a lock's owner, a server record: ~300 bytes each).
MAX_SMALL_BYTES = 64 * 1024

#: Why a record was refused: too big, nested too deep, not JSON (a JSON line cut short is one), not of its shape.
Why = Literal["size", "depth", "json", "shape"]
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class DamagedRecord(LedgerError):
    """A record latentforge wrote that does not read back as one: the message names the file and what repairs it.
    `why` says which check refused it (a journal's last line that is not JSON is a torn append, not damage)."""

    def __init__(self, message: str, why: Why = "shape") -> None:
        super().__init__(message)
        self.why = why


def loads(
    data: str | bytes,
    where: str,
    what: str = "a record of latentforge's",
    repair: str = "",
    max_bytes: int = MAX_RECORD_BYTES,
) -> Any:
    """The JSON value of `data`, read from `where` (a file, or ``file:line``), bounded: more than `max_bytes`, a
    nesting deeper than `MAX_DEPTH`, or not JSON is a `DamagedRecord` of one line: ``WHERE: not WHAT (why); REPAIR``.
    """
    if len(data) > max_bytes:
        raise damaged(where, what, f"{len(data)} bytes, over the {max_bytes} a record may have", repair, "size")
    try:
        value = json.loads(data)
    except RecursionError:
        raise damaged(where, what, f"nested deeper than {MAX_DEPTH}", repair, "depth") from None
    except (ValueError, TypeError) as exc:
        raise damaged(where, what, _first_line(exc), repair, "json") from None
    if _brackets(data) > MAX_DEPTH and depth_over(value, MAX_DEPTH):  # fewer brackets cannot nest deeper (a row)
        raise damaged(where, what, f"nested deeper than {MAX_DEPTH}", repair, "depth")
    return value


def _brackets(data: str | bytes) -> int:
    """How many ``[`` and ``{`` `data` holds (strings included: an upper bound of its nesting), counted in C."""
    if isinstance(data, str):
        return data.count("[") + data.count("{")
    return data.count(b"[") + data.count(b"{")


def lines(
    stream: Iterable[str], where: str, what: str, repair: str = "", max_bytes: int = MAX_RECORD_BYTES
) -> Iterator[Any]:
    """The JSON value of each line of `stream` (a file open for text, read as it comes), each bounded as `loads`
    bounds a record; a line that fails is a `DamagedRecord` naming ``where:N``."""
    for number, line in enumerate(stream, 1):
        yield loads(line, f"{where}:{number}", what, repair, max_bytes)


def model(cls: type[M], value: Any, where: str, what: str, repair: str = "") -> M:
    """`value` (parsed by `loads`) validated as `cls`; a value of another shape is a `DamagedRecord` of one line that
    says its first error (pydantic's own message is several lines)."""
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        raise damaged(where, what, shape_error(exc), repair) from None


def dataclass_of(cls: type[T], value: Any, where: str, what: str, repair: str = "") -> T:
    """`value` (parsed by `loads`) as the dataclass `cls`, its fields converted to their types (pydantic's lax mode);
    a `DamagedRecord` of one line otherwise (a record that is no object, a field missing or of another type)."""
    if not isinstance(value, dict):
        raise damaged(where, what, f"a JSON {type(value).__name__}, not an object", repair)
    try:
        return TypeAdapter(cls).validate_python(value)
    except ValidationError as exc:
        raise damaged(where, what, shape_error(exc), repair) from None


def shape_error(exc: ValidationError) -> str:
    """A validation error in a few words: its first error's field and message, and how many there are."""
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return "not of its shape"
    first = errors[0]
    field = ".".join(str(part) for part in first.get("loc", ())) or "the record"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{field}: {' '.join(str(first.get('msg', '')).split())}{more}"


def damaged(where: str, what: str, why: str, repair: str = "", kind: Why = "shape") -> DamagedRecord:
    """The one-line error of a record at `where` that is not `what`: why, and what repairs it."""
    line = " ".join(f"{where}: not {what} ({why})".split())
    return DamagedRecord(line + (f"; {repair}" if repair else ""), kind)


def warn(exc: DamagedRecord | str) -> None:
    """Say that a damaged record is treated as absent (its message says what makes it again): one warning line naming
    the file. A caller that reads a record twice in one command warns once (the first read)."""
    logger.warning("%s", exc)


def depth_over(value: Any, limit: int) -> bool:
    """Whether `value` (a parsed JSON value) nests deeper than `limit` containers (iteratively: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
