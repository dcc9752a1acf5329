"""Records read back from an OUT in an object store (and the local lock's): a journal part that does not read back
is one line naming it; an overwrite token covers the store's keys, sizes and ETags. Lease and lock records
(`infra.cache.lock`): a lease object in a store whose record does not read back as
ours (a timestamp of another type or form, a number, NaN, a huge or negative one, not JSON, nested deep) is a hold,
never taken over on a guess: a second run stops with one line naming the object and the command that clears it; a
lease whose expiry is valid but in another form (another zone, no zone: UTC) is judged by it; the lease length
setting is bounded (`infra.bounds`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from infra import outdir
from infra.cache import ledger
from infra.cache.lock import (
    LEASE_ENV,
    LOCK_NAME,
    LockedError,
    check_not_locked,
    lease_seconds,
    out_lock,
    recorded_owner,
)
from infra.errors import ConfigError
from infra.gates.conflicts import overwrite_token
from infra.outstore import StoreOut
from infra.records import DamagedRecord
from tests.s3_proxy import module_s3

BUCKET = "lf-lease"
s3 = module_s3(BUCKET, "AKIDLEASETEST", "lease-secret-never-written")

OWNER = {"pid": 4242, "host": "another-host", "create_time": 1.5, "since": "2026-01-01T00:00:00+00:00"}
PAST = (datetime.now(UTC) - timedelta(hours=1)).isoformat(timespec="seconds")

#: Lease records that are not ours to judge: each a hold (a second run stops; nothing taken over).
UNREADABLE = {
    "expiry a number": {**OWNER, "expires": 1e12},
    "expiry a huge number": {**OWNER, "expires": 10**400},
    "expiry negative": {**OWNER, "expires": -1},
    "expiry NaN": {**OWNER, "expires": float("nan")},
    "expiry a bool": {**OWNER, "expires": True},
    "expiry not a time": {**OWNER, "expires": "soon"},
    "expiry years ahead": {**OWNER, "expires": "9999-12-31T23:59:59+00:00"},
    "pid a string": {**OWNER, "pid": "4242", "expires": PAST},
    "pid negative": {**OWNER, "pid": -7, "expires": PAST},
    "no owner": {"expires": PAST},
    "a list": [OWNER],
}


def _put(out: StoreOut, record: object) -> None:
    body = record if isinstance(record, bytes) else json.dumps(record).encode()
    out.put(LOCK_NAME, body)


@pytest.mark.parametrize("name", [*UNREADABLE, "nested deep", "not JSON"])
def test_a_lease_record_that_does_not_read_back_is_a_hold_named_in_one_line(s3, name):
    out = StoreOut.of(f"s3://{BUCKET}/held-{name.replace(' ', '-')}")
    record = {"nested deep": b"[" * 50_000 + b"]" * 50_000, "not JSON": b"\x00lease"}.get(name, UNREADABLE.get(name))
    _put(out, record)
    before = outdir.read_bytes(out, LOCK_NAME)
    for attempt in (lambda: check_not_locked(out), lambda: out_lock(out).__enter__()):
        with pytest.raises(LockedError) as caught:
            attempt()
        line = str(caught.value)
        assert "\n" not in line and f"{out}/{LOCK_NAME}" in line, line
        assert "aws s3 rm" in line and "if no run is writing" in line, line
    assert outdir.read_bytes(out, LOCK_NAME) == before  # never taken over


@pytest.mark.parametrize(
    "expires",
    [
        (datetime.now(UTC) - timedelta(hours=1)).replace(tzinfo=None).isoformat(),  # no zone: UTC
        (datetime.now(UTC) - timedelta(hours=1)).astimezone(timezone(timedelta(hours=5))).isoformat(),
        (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%d"),
    ],
    ids=["no-zone", "another-zone", "a-date"],  # fixed ids: every xdist worker collects the same tests
)
def test_an_expired_lease_in_another_valid_form_is_taken_over(s3, expires):
    out = StoreOut.of(f"s3://{BUCKET}/expired-{abs(hash(expires))}")
    _put(out, {**OWNER, "expires": expires})
    check_not_locked(out)
    with out_lock(out):
        assert json.loads(outdir.read_bytes(out, LOCK_NAME))["host"] != "another-host"


def test_a_live_lease_in_another_zone_is_live(s3):
    out = StoreOut.of(f"s3://{BUCKET}/live-zone")
    ahead = (datetime.now(UTC) + timedelta(seconds=60)).astimezone(timezone(timedelta(hours=-7)))
    _put(out, {**OWNER, "expires": ahead.isoformat()})
    with pytest.raises(LockedError, match="being written by another run: pid 4242 on another-host"):
        check_not_locked(out)


@pytest.mark.parametrize("raw", ["inf", "nan", "-1", "0", "0.1", "1e308", "86401", "soon"])
def test_the_lease_length_setting_is_bounded(monkeypatch, raw):
    monkeypatch.setenv(LEASE_ENV, raw)
    with pytest.raises(ConfigError) as caught:
        lease_seconds()
    assert LEASE_ENV in str(caught.value) and "\n" not in str(caught.value)


def test_a_lease_length_within_the_bounds_is_taken(monkeypatch):
    monkeypatch.setenv(LEASE_ENV, "2")
    assert lease_seconds() == (2.0, 0.5)


@pytest.mark.parametrize(
    "record",
    [b"[" * 4000, b'{"pid": -3, "host": "h", "create_time": null, "since": "x"}', b'{"pid": 1.5}', b"\xff\xfe"],
)
def test_a_local_lock_record_that_does_not_read_back_is_a_hold_named_in_one_line(tmp_path, record):
    """Under a free kernel lock a record names a run that did not release; one that does not read back names no run
    this host can check: the run stops, naming the file and the command that clears it (before: a nested record was a
    RecursionError; one naming pid -3 on this host was taken over as a run that is gone)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_bytes(record)
    with pytest.raises(LockedError) as caught, out_lock(out):
        pass
    line = str(caught.value)
    assert "\n" not in line and str(out / LOCK_NAME) in line and "rm -- " in line, line
    assert (out / LOCK_NAME).read_bytes() == record  # left as it was found
    assert recorded_owner(out) is None


def test_a_damaged_journal_part_in_a_store_is_one_line_naming_it_and_its_repair(s3):
    """A journal part is put whole (a conditional put), so a part that does not read back is damage, not a torn
    append: one line naming the object and the command that moves it aside (before: a RecursionError)."""
    out = StoreOut.of(f"s3://{BUCKET}/journal")
    out.put("ledger/s0.journal/00000000.jsonl", b"[" * 5000 + b"]" * 5000 + b"\n")
    with pytest.raises(DamagedRecord) as caught:
        ledger.read_shard(out, "s0")
    line = str(caught.value)
    assert line.startswith(f"{out}/ledger/s0.journal/00000000.jsonl:1: not a ledger line (nested deeper than")
    assert "aws s3 mv -- " in line and f"{out}.damaged/ledger/s0.journal/00000000.jsonl" in line and "\n" not in line


def test_an_overwrite_token_for_a_store_covers_its_keys_sizes_and_etags(s3):
    out = StoreOut.of(f"s3://{BUCKET}/token")
    out.put("g/a.pt", b"aaaa")
    first = overwrite_token(out, None, "f" * 64)
    out.put("g/a.pt", b"aaaa")  # the same bytes again: the same ETag
    assert overwrite_token(out, None, "f" * 64) == first
    out.put("g/a.pt", b"bbbb")  # the same size, other bytes: another ETag
    second = overwrite_token(out, None, "f" * 64)
    assert second != first and second[:12] == first[:12]
    out.put(LOCK_NAME, b"{}")  # the lease: not covered
    assert overwrite_token(out, None, "f" * 64) == second
    out.put("g/b.pt", b"b")
    assert overwrite_token(out, None, "f" * 64) != second
