"""Records latentforge wrote and reads back, parsed bounded (DESIGN, invariant 10: nothing read back is trusted).

Every record latentforge writes and later reads (a listing, the recorded plan, a ledger or journal line, a lease, a
server record, cache.json, a report) is parsed here: bounded in size before a byte is parsed, bounded in nesting
(Python's parser ends in a RecursionError on a few thousand ``[``, whose traceback names no file), and a failure is
one `DamagedRecord` line that names the file, what it should have held, and the command that repairs it. What the
record's caller then does is its own: prove it against what it describes, or treat it as absent and rebuild it.
"""

from __future__ import annotations

import json
from typing import Any

from infra.errors import LedgerError

#: The deepest nesting any record of latentforge's has (a ledger row's extra holds small dicts of lists): far more is
#: not ours, and is refused before it reaches a validator or a serializer that recurses.
MAX_DEPTH = 32
#: The largest single record (a JSON document or one JSON line) read back: a ledger line is ~1 KiB, cache.json and a
#: report a few KiB, a plan index ~200 bytes a shard (5 MiB: 25,000 shards).
MAX_RECORD_BYTES = 64 * 1024 * 1024


class DamagedRecord(LedgerError):
    """A record latentforge wrote that does not read back as one: the message names the file and what repairs it."""


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
        raise damaged(where, what, f"{len(data)} bytes, over the {max_bytes} a record may have", repair)
    try:
        value = json.loads(data)
    except RecursionError:
        raise damaged(where, what, f"nested deeper than {MAX_DEPTH}", repair) from None
    except (ValueError, TypeError) as exc:
        raise damaged(where, what, _first_line(exc), repair) from None
    if depth_over(value, MAX_DEPTH):
        raise damaged(where, what, f"nested deeper than {MAX_DEPTH}", repair)
    return value


def damaged(where: str, what: str, why: str, repair: str = "") -> DamagedRecord:
    """The one-line error of a record at `where` that is not `what`: why, and what repairs it."""
    return DamagedRecord(f"{where}: not {what} ({why})" + (f"; {repair}" if repair else ""))


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
