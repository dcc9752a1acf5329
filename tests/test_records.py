"""Records read back are parsed bounded (`infra.records`): any bytes give a value or one `DamagedRecord` line that
names the file, never a RecursionError or a traceback."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.records import MAX_DEPTH, DamagedRecord, depth_over, loads


def test_deep_nesting_is_one_line_naming_the_file() -> None:
    for text in ("[" * 100_000 + "]" * 100_000, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)):
        with pytest.raises(DamagedRecord) as caught:
            loads(text, "OUT/ledger/00000.jsonl:3", "a ledger row", "run latentforge verify OUT")
        message = str(caught.value)
        assert message.startswith("OUT/ledger/00000.jsonl:3: not a ledger row (nested deeper than")
        assert message.endswith("; run latentforge verify OUT") and "\n" not in message


def test_a_record_over_its_size_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(DamagedRecord, match="over the 10 a record may have"):
        loads("[" + "1," * 20 + "1]", "f", max_bytes=10)


def test_nesting_up_to_the_bound_reads() -> None:
    value: list = []
    for _ in range(MAX_DEPTH - 1):
        value = [value]
    assert loads(json.dumps(value), "f") == value
    assert not depth_over(value, MAX_DEPTH) and depth_over([value, 1], MAX_DEPTH - 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512) | st.text(alphabet='[]{}":,0 a', max_size=4000))
def test_any_bytes_give_a_value_or_one_damaged_line(data: bytes | str) -> None:
    try:
        loads(data, "where")
    except DamagedRecord as exc:
        assert str(exc).startswith("where: not ") and "\n" not in str(exc)
