"""The per-shard ledger: journal + seal, torn and corrupt lines, and what a rerun does with each row."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from flows.terminal_run import run_build
from infra.cache.ledger import Journal, LedgerRow, journal_path, read_all, read_shard, seal, sealed_path
from infra.errors import LedgerError
from infra.gates.conflicts import overwrite_token
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip


def _row(key: str, status: str = "done", **fields) -> LedgerRow:
    return LedgerRow(key=key, id=key.rsplit("/", 1)[-1], group="g", shard="s1", status=status, **fields)


def _target(out, item):
    return out / item.generator / f"{item.task}_{item.index:08d}.pt"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def short_videos(clips) -> list[bytes]:
    """Three real clips cut to a few small frames: quick to decode and encode."""
    return [
        cut_clip(clips["carphone"], 9, width=96),
        cut_clip(clips["bikes"], 9, width=128),
        cut_clip(clips["bigbuckbunny"], 9, width=128),
    ]


# --- plain ledger functions -----------------------------------------------------------------------------

#: Texts a reason, a detail, a key or a name can hold: lone surrogates (a name not UTF-8, a JSON "\ud800"), a NUL,
#: control characters, the line separators str.splitlines cuts at, and far more than a row keeps.
HOSTILE_TEXTS = (
    "c\udcff.mp4",
    "\ud800 alone",
    "nul\x00 in it",
    "bell\x07 tab\t cr\r",
    "line\u2028sep\u2029par\x85nel\x1cfs",
    "Straße \N{GRINNING FACE}",
    "x" * 100_000,
)


def test_any_text_is_written_and_read_back_as_one_row(tmp_path):
    """Before: a lone surrogate made Journal.append raise UnicodeEncodeError (the shard crashed, and every resume
    at the same row); a U+2028 in a text cut its line in two on reading."""
    rows = [
        _row(f"k{i}/{text[:50]}", "skipped", reason=text, detail=text, extra={"name": text, text[:9]: 1})
        for i, text in enumerate(HOSTILE_TEXTS)
    ]
    with Journal(tmp_path, "s1") as journal:
        for row in rows:
            journal.append(row)
    lines = journal_path(tmp_path, "s1").read_bytes().decode("utf-8").split("\n")
    assert len(lines) == len(rows) + 1 and lines[-1] == "" and all(json.loads(line) for line in lines[:-1])
    journalled = list(read_shard(tmp_path, "s1").values())
    seal(tmp_path, "s1", journalled)
    sealed = list(read_shard(tmp_path, "s1").values())
    assert len(sealed) == len(rows) and sealed == journalled
    for row, text in zip(sealed, HOSTILE_TEXTS, strict=True):
        row.to_json().encode("utf-8")  # and written again as it is
        assert len(row.detail) <= 4000 and (row.detail == text or len(text) > 4000 or "\\" in row.detail)
    assert sealed[0].key == "k0/c\\xff.mp4" and sealed[0].detail == "c\\xff.mp4"
    assert sealed[1].detail == "\\ud800 alone" and sealed[4].detail == HOSTILE_TEXTS[4]
    assert sealed[-1].detail.endswith("… (96040 more characters)")


def test_journal_then_seal_round_trip_and_the_journal_wins(tmp_path):
    out = tmp_path
    first = [
        _row("g/t_task/t_00000000", path="g/t_00000000.pt", bytes=123, sha256="ab" * 32, source_shape=[7, 9, 16, 3]),
        _row("g/t_task/t_00000001", "skipped", reason="missing_prompt", detail="the sample has no prompt file"),
        _row("g/t_task/t_00000002", "failed", reason="encode_error", detail="RuntimeError: boom", extra={"n": 1}),
    ]
    with Journal(out, "s1") as journal:
        for row in first:
            journal.append(row)
    assert journal_path(out, "s1").read_text().count("\n") == 3
    assert read_shard(out, "s1") == {r.key: r for r in first}  # every field survives the JSON line

    assert seal(out, "s1", first) == sealed_path(out, "s1")
    assert not journal_path(out, "s1").exists(), "sealing must drop the journal"
    assert len(sealed_path(out, "s1").read_text().splitlines()) == 3
    assert read_shard(out, "s1") == {r.key: r for r in first}

    # A later run journals a new fate for a sealed sample: the journal row is the one that counts.
    redone = _row("g/t_task/t_00000002", path="g/t_00000002.pt", bytes=99, sha256="cd" * 32)
    new = _row("g/t_task/t_00000003", "skipped", reason="empty_video")
    with Journal(out, "s1") as journal:
        journal.append(redone)
        journal.append(new)
    rows = read_shard(out, "s1")
    assert rows == {first[0].key: first[0], first[1].key: first[1], redone.key: redone, new.key: new}

    # Resealing replaces the sealed ledger atomically and drops the journal again.
    seal(out, "s1", rows.values())
    assert read_shard(out, "s1") == rows and not journal_path(out, "s1").exists()

    with Journal(out, "s2") as journal:  # a shard that only has a journal (a crashed run)
        journal.append(_row("g/t_task/t_00000009"))
    seal(out, "s3", [_row("g/t_task/t_00000010", "skipped", reason="missing_video")])  # only sealed
    everything = read_all(out)
    assert sorted(everything) == ["s1", "s2", "s3"]
    assert everything["s1"] == rows
    assert list(everything["s2"]) == ["g/t_task/t_00000009"]
    assert everything["s3"]["g/t_task/t_00000010"].reason == "missing_video"
    assert read_all(tmp_path / "no-such-cache") == {}


def test_unknown_keys_in_a_row_are_an_error_even_on_the_last_journal_line(tmp_path):
    data = json.loads(_row("k").to_json()) | {"added_by_a_newer_version": 1}
    journal_path(tmp_path, "s1").parent.mkdir(parents=True)
    journal_path(tmp_path, "s1").write_text(json.dumps(data) + "\n")
    with pytest.raises(LedgerError, match="added_by_a_newer_version"):
        read_shard(tmp_path, "s1")


def test_a_torn_last_journal_line_is_ignored_and_a_corrupt_one_elsewhere_is_an_error(tmp_path):
    a, b, c = _row("a"), _row("b", "skipped", reason="empty_video"), _row("c")
    with Journal(tmp_path, "s1") as journal:
        journal.append(a)
        journal.append(b)
    path = journal_path(tmp_path, "s1")
    with path.open("a") as fh:
        fh.write(c.to_json()[:40])  # a crash mid-append: half a line, no newline
    assert read_shard(tmp_path, "s1") == {"a": a, "b": b}

    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"key": "x", "stat', lines[1]]) + "\n")  # the bad line is not the last
    with pytest.raises(ValueError, match=rf"{path}:2: not a ledger line"):
        read_shard(tmp_path, "s1")

    # A sealed ledger is written atomically, so even a bad last line there is corruption, not a crash.
    sealed = sealed_path(tmp_path, "s2")
    sealed.write_text(a.to_json() + "\n" + b.to_json()[:30])
    with pytest.raises(ValueError, match=rf"{sealed}:2: not a ledger line"):
        read_shard(tmp_path, "s2")


def test_rows_journalled_after_a_torn_line_stay_readable(tmp_path):
    a, torn, c, d = _row("a"), _row("b"), _row("c"), _row("d")
    with Journal(tmp_path, "s1") as journal:  # run 1 journals a, then dies mid-append of b
        journal.append(a)
    with journal_path(tmp_path, "s1").open("a") as fh:
        fh.write(torn.to_json()[:40])
    with Journal(tmp_path, "s1") as journal:  # run 2 resumes, journals c and d, then dies too
        journal.append(c)
        journal.append(d)
    assert read_shard(tmp_path, "s1") == {"a": a, "c": c, "d": d}  # run 3 must be able to resume


def test_a_line_that_is_json_but_not_a_row_is_a_value_error(tmp_path):
    path = journal_path(tmp_path, "s1")
    path.parent.mkdir(parents=True)
    path.write_text(_row("a").to_json() + "\n[]\n" + _row("b").to_json() + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2:"):
        read_shard(tmp_path, "s1")


# --- resume, through the flow ---------------------------------------------------------------------------


def test_a_rerun_stops_at_a_damaged_file_and_an_approved_overwrite_redoes_it(tmp_path, tiny_model, short_videos):
    items = [sample(i % 2, i, short_videos[i % 3], f"clip {i}: a short scene".encode()) for i in range(4)]
    src = make_shards(tmp_path / "src", {"shard-00000": items})
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out))
    assert ok, result
    assert (result["done"], result["encoded"]) == (4, 4)
    before = {item.sample_dir: _sha(_target(out, item)) for item in items}

    missing, damaged = _target(out, items[0]), _target(out, items[1])
    missing.unlink()
    with damaged.open("r+b") as fh:
        fh.truncate(damaged.stat().st_size // 2)
    damaged_bytes = damaged.read_bytes()

    # A done sample that no longer loads is damage: the run stops at the gate and changes nothing.
    ok, message = run_build(config(src, tiny_model, out))
    assert not ok and "damaged" in message.lower() and str(damaged) in message
    assert not missing.exists() and damaged.read_bytes() == damaged_bytes

    # An overwrite approved for this OUT and this fingerprint re-encodes both, to the same bytes.
    fingerprint = json.loads((out / "cache.json").read_text())["fingerprint"]
    token = overwrite_token(out, fingerprint, fingerprint)
    ok, result = run_build(config(src, tiny_model, out, approve_overwrite=token))
    assert ok, result
    assert (result["done"], result["encoded"], result["reused"]) == (4, 2, 2), result
    assert {item.sample_dir: _sha(_target(out, item)) for item in items} == before
    rows = read_shard(out, "shard-00000")
    assert rows[items[1].sample_dir].extra["replaced"] == fingerprint
    assert not journal_path(out, "shard-00000").exists()

    # Files this spec wrote but the ledger lost (a crash between the link and the journal line) are adopted.
    sealed_path(out, "shard-00000").unlink()
    untouched = {item.sample_dir: _target(out, item).stat().st_ino for item in items}
    ok, result = run_build(config(src, tiny_model, out))
    assert ok, result
    assert (result["done"], result["failed"], result["encoded"], result["reused"]) == (4, 0, 0, 4), result
    rows = read_shard(out, "shard-00000")
    for item in items:
        row = rows[item.sample_dir]
        assert (row.status, row.sha256, row.bytes) == (
            "done",
            before[item.sample_dir],
            _target(out, item).stat().st_size,
        )
    assert {item.sample_dir: _target(out, item).stat().st_ino for item in items} == untouched


def test_a_foreign_file_at_a_target_path_is_never_overwritten(tmp_path, tiny_model, short_videos):
    items = [sample(i % 2, i, short_videos[i % 3], f"clip {i}: a short scene".encode()) for i in range(4)]
    src = make_shards(tmp_path / "src", {"shard-a": items[:2], "shard-b": items[2:]})

    # Into a fresh OUT: the directory is not a latentforge cache, so the run writes nothing at all.
    fresh = tmp_path / "fresh"
    _target(fresh, items[2]).parent.mkdir(parents=True)
    _target(fresh, items[2]).write_bytes(b"somebody else's file")
    before = tree_hashes(fresh)
    ok, result = run_build(config(src, tiny_model, fresh))
    assert not ok and "foreign" in str(result)
    assert tree_hashes(fresh) == before

    # Into this cache, before those samples were first encoded: those samples fail, the rest are done.
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out, shard_filter="shard-a"))
    assert ok and result["done"] == 2, result
    other_spec, garbage = _target(out, items[2]), _target(out, items[3])
    other_spec.parent.mkdir(parents=True, exist_ok=True)
    garbage.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"x0": torch.zeros(2), "fingerprint": "another spec"}, other_spec)
    garbage.write_bytes(b"not a torch file at all")
    foreign = {p: p.read_bytes() for p in (other_spec, garbage)}

    ok, result = run_build(config(src, tiny_model, out))
    assert ok, result
    assert (result["done"], result["failed"], result["reused"]) == (2, 2, 2), result
    assert result["reasons"] == {"output_exists": 2}
    for path, data in foreign.items():
        assert path.read_bytes() == data, f"{path} was overwritten"
    rows = read_all(out)
    assert sorted(rows) == ["shard-a", "shard-b"]
    for item in items[2:]:
        row = rows["shard-b"][item.sample_dir]
        assert (row.status, row.reason, row.sha256) == ("failed", "output_exists", None)
        assert row.path == str(_target(out, item).relative_to(out))
    assert all(row.status == "done" for row in rows["shard-a"].values())


# --- one row per sample ---------------------------------------------------------------------------------


def test_every_source_sample_gets_exactly_one_row(tmp_path, tiny_model, clips, short_videos):
    items = [
        sample(0, 0, short_videos[0], b"A man talks in the back seat of a car."),
        sample(1, 1, short_videos[1], None),  # no prompt.txt
        sample(0, 2, b"", b"An empty video file."),
        sample(1, 3, clips["audio_only"], b"Only a sound track."),
        sample(0, 4, None, b"No video file at all."),
        sample(1, 5, b"this is not a video container", b"Garbage bytes."),
        sample(0, 6, short_videos[2], b"   \n"),  # a prompt of whitespace only
        sample(1, 7, short_videos[2], b"A large grey rabbit in a meadow."),
    ]
    expected = {
        items[0].sample_dir: ("done", None),
        items[1].sample_dir: ("skipped", "missing_prompt"),
        items[2].sample_dir: ("skipped", "empty_video"),
        items[3].sample_dir: ("skipped", "no_video_stream"),
        items[4].sample_dir: ("skipped", "missing_video"),
        items[5].sample_dir: ("skipped", "video_decode_error"),
        items[6].sample_dir: ("skipped", "empty_prompt"),
        items[7].sample_dir: ("done", None),
    }
    src = make_shards(tmp_path / "src", {"mixed": items})
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out))
    assert ok, result
    assert (result["samples"], result["done"], result["skipped"], result["failed"]) == (8, 2, 6, 0), result

    lines = sealed_path(out, "mixed").read_text().splitlines()
    assert len(lines) == len(items), "one sealed line per sample, no duplicates"
    rows = read_shard(out, "mixed")
    assert {key: (row.status, row.reason) for key, row in rows.items()} == expected
    for item in items:
        row = rows[item.sample_dir]
        assert row.shard == "mixed" and row.group == item.generator
        if row.status == "done":
            path = out / row.path
            assert path == _target(out, item)
            assert row.bytes == path.stat().st_size
            assert row.sha256 == _sha(path)
        else:
            assert row.detail and row.path is None and row.sha256 is None
            assert not _target(out, item).exists()
    assert sorted(p.relative_to(out) for p in out.rglob("*.pt")) == sorted(
        _target(out, item).relative_to(out) for item in (items[0], items[7])
    )
