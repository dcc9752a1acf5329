"""Records read back are parsed bounded (`infra.records`): any bytes give a value or one `DamagedRecord` line that
names the file, never a RecursionError or a traceback."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.errors import ServerError
from infra.formats import get_format
from infra.formats.shards import part_record
from infra.ops import ephemeral, server
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


def test_server_records_that_do_not_read_back_are_left_or_refused_in_one_line(tmp_path, caplog):
    """An embedded server's record (`infra.ops.ephemeral`) that does not read back is left to a person with one
    warning line naming it; `latentforge server`'s state file is a one-line ServerError (before: a nested record was a
    RecursionError; a pid that names no process reached psutil)."""
    folder = ephemeral.records_dir(tmp_path)
    folder.mkdir(parents=True)
    (folder / "1.json").write_text("[" * 5000 + "]" * 5000)
    record = {"server_pid": -4, "server_create_time": 1.0, "owner_pid": True, "owner_create_time": float("nan")}
    (folder / "2.json").write_text(json.dumps({**record, "host": "h", "port": None, "started_at": "x"}))
    (folder / "3.json").write_text(json.dumps({"server_pid": "seven"}))
    with caplog.at_level("WARNING"):
        assert ephemeral.reap_orphans(tmp_path) == []
    assert {p.name for p in folder.iterdir()} >= {"1.json", "3.json"}
    named = [r.getMessage() for r in caplog.records if "1.json" in r.getMessage() or "3.json" in r.getMessage()]
    assert len(named) == 2 and all("\n" not in line and "left as it is" in line for line in named), named
    state = server.state_dir(tmp_path)
    state.mkdir(parents=True)
    (state / server.STATE_FILE).write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ServerError) as caught:
        server.read_state(state)
    assert str(caught.value).startswith(f"unreadable: {state / server.STATE_FILE}: not a server state record (nested")


def test_a_part_record_that_does_not_read_back_names_itself_and_moves_aside_with_its_part(tmp_path):
    """A shard part's record is the part's proof (its size and sha256 as written): never made again over damage."""
    out = tmp_path / "out"
    (out / "ledger" / "parts").mkdir(parents=True)
    (out / "ledger" / "parts" / "00000.tar.json").write_text('{"path": "shards/00000.tar", "bytes": "many"}')
    with pytest.raises(DamagedRecord) as caught:
        part_record(out, "shards/00000.tar", get_format("webdataset"))  # type: ignore[arg-type]
    line = str(caught.value)
    assert line.startswith(f"{out}/ledger/parts/00000.tar.json: not a part record (") and "\n" not in line
    assert f"mv -- {out}/shards/00000.tar {tmp_path}/out.damaged/shards/00000.tar" in line
    assert f"mv -- {out}/ledger/parts/00000.tar.json {tmp_path}/out.damaged/ledger/parts/00000.tar.json" in line
