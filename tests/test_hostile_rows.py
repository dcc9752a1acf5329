"""Hostile rows of a metadata file (`meta:` csv, json, jsonl): each bad row is exactly one skipped ledger row with its
reason, every good row is built, nothing crashes.

Generated (hypothesis): a few good rows among rows with a field of the wrong type, a NUL in a path, a huge field, a
row nested 100,000 deep, a missing field, bytes that are not UTF-8, a row that is not an object or not JSON; then
the real plan and the shard loop (tiny Wan2.2, a real clip, 5×32²). The issue's four attacks (``"audio": 5``, a NUL
in a path, a CSV field over 128 KiB, 100k-deep JSON) each have their explicit test, and one build through the
command line, where each one used to end the run with Prefect's tracebacks, exit 1.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from infra.cache import ledger
from infra.errors import InputError
from infra.plan import make_plan
from infra.preprocess.read import read
from infra.preprocess.shard import process_shard
from infra.sources import open_source
from tests.conftest import config
from tests.media_utils import cut_clip

GEOMETRY = {"frames": 5, "height": 32, "width": 32}
DEEP = 100_000  # the nesting: far past the JSON parser's recursion limit
CSV_FIELD = 200 * 1024  # over the csv module's 128 KiB field limit
NOT_UTF8 = b"\xff\xfe"
CAPTION = "a clip"  # every row's: the text encoder runs once (its cache keeps the embedding), the tests stay cheap
runner = CliRunner()


@dataclass(frozen=True)
class Planted:
    """One row as the file holds it (bytes of a jsonl line, a json element or a csv record) and what the ledger
    must say of it: (key, status, reason)."""

    raw: bytes
    key: str
    status: str
    reason: str | None


def _json_row(index: int, kind: str, value: object = None) -> Planted:
    """Row `index` (1-based) of kind `kind` as JSON bytes, with its expected ledger row."""
    path, key = f"r{index}.mp4", f"row-{index:08d}"
    row: dict[str, object] = {"video": path, "caption": CAPTION}
    bad = ("skipped", "bad_row")
    if kind == "good":
        return Planted(json.dumps(row).encode(), path, "done", None)
    if kind == "deep":
        return Planted(b'{"video": ' + b"[" * DEEP + b"]" * DEEP + b"}", key, *bad)
    if kind == "not_object":
        return Planted(json.dumps(value).encode(), key, *bad)
    if kind in ("video", "caption", "audio"):  # a field of the wrong type
        row[kind] = value
        return Planted(json.dumps(row).encode(), key, *bad)
    if kind in ("nul_video", "nul_audio"):
        row[kind.removeprefix("nul_")] = "r\0x.mp4"
        return Planted(json.dumps(row).encode(), key, *bad)
    if kind == "long_path":
        row["video"] = "v" * 5000 + ".mp4"
        return Planted(json.dumps(row).encode(), key, *bad)
    if kind == "no_video":
        del row["video"]
        return Planted(json.dumps(row).encode(), key, *bad)
    if kind == "no_caption":
        del row["caption"]
        return Planted(json.dumps(row).encode(), path, "skipped", "missing_prompt")
    if kind == "huge_caption":  # over the 1 MiB a prompt may have
        row["caption"] = "w " * (600 * 1024)
        return Planted(json.dumps(row).encode(), path, "skipped", "prompt_too_long")
    if kind == "caption_not_utf8":
        raw = json.dumps(row).encode().replace(CAPTION.encode(), NOT_UTF8)
        return Planted(raw, path, "skipped", "prompt_not_utf8")
    if kind == "video_not_utf8":
        return Planted(json.dumps(row).encode().replace(b'.mp4"', NOT_UTF8 + b'.mp4"'), key, "skipped", "bad_layout")
    if kind == "deep_extra":  # deep, but in a column nobody reads, within the parser's reach: a good row
        row["extra"] = json.loads("[" * 200 + "]" * 200)
        return Planted(json.dumps(row).encode() + b" ", path, "done", None)
    assert kind == "not_json"
    return Planted(b'{"video": "' + path.encode() + b'", caption', key, *bad)


def _csv_row(index: int, kind: str) -> Planted:
    path, key = f"r{index}.mp4", f"row-{index:08d}"
    video, caption = path, CAPTION
    expected: tuple[str, str, str | None] = (key, "skipped", "bad_row")
    if kind == "good":
        expected = (path, "done", None)
    elif kind == "nul_video":
        video = "r\0x.mp4"
    elif kind == "huge_field":
        caption = "w" * CSV_FIELD
    elif kind == "no_video":
        video = ""
    elif kind == "no_caption":
        caption, expected = "", (path, "skipped", "empty_prompt")  # a CSV's empty cell is the empty caption
    elif kind == "caption_not_utf8":
        caption, expected = "a \udcff\udcfe clip", (path, "skipped", "prompt_not_utf8")  # bytes ff fe
    else:
        assert kind == "video_not_utf8"
        video, expected = f"r{index}\udcff.mp4", (key, "skipped", "bad_layout")
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow([video, caption])
    return Planted(text.getvalue().encode("utf-8", "surrogateescape"), *expected)


JSON_KINDS = (
    "deep", "not_object", "video", "caption", "audio", "nul_video", "nul_audio", "long_path", "no_video", "no_caption",
    "huge_caption", "caption_not_utf8", "video_not_utf8", "deep_extra",
)  # fmt: skip
CSV_KINDS = ("nul_video", "huge_field", "no_video", "no_caption", "caption_not_utf8", "video_not_utf8")
#: Values of the wrong type for a path or caption column (a list's first entry is not text either).
WRONG = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.booleans(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.one_of(st.integers(), st.none()), min_size=1, max_size=3),
)
NOT_OBJECT = st.one_of(st.integers(), st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2))


@st.composite
def metadata(draw: st.DrawFn) -> tuple[str, list[tuple[str, object]]]:
    """(suffix, [(kind, value), ...]): one or two good rows among one to four hostile ones, in a random order."""
    suffix = draw(st.sampled_from([".jsonl", ".json", ".csv"]))
    hostile = CSV_KINDS if suffix == ".csv" else (*JSON_KINDS, *(("not_json",) if suffix == ".jsonl" else ()))
    rows: list[tuple[str, object]] = [("good", None)] * draw(st.integers(1, 2))
    for kind in draw(st.lists(st.sampled_from(hostile), min_size=1, max_size=4)):
        rows.append((kind, draw(NOT_OBJECT if kind == "not_object" else WRONG)))
    return suffix, draw(st.permutations(rows))


def _write(folder: Path, suffix: str, rows: list[tuple[str, object]], clip: bytes) -> tuple[Path, list[Planted]]:
    """The metadata file (and a clip for every row) under `folder`; the rows planted."""
    folder.mkdir(parents=True)
    planted = []
    for index, (kind, value) in enumerate(rows, 1):
        (folder / f"r{index}.mp4").write_bytes(clip)
        planted.append(_csv_row(index, kind) if suffix == ".csv" else _json_row(index, kind, value))
    raws = [p.raw for p in planted]
    data = {
        ".jsonl": b"".join(raw + b"\n" for raw in raws),
        ".json": b"[" + b",\n".join(raws) + b"]",
        ".csv": b"video,caption\n" + b"".join(raws),
    }[suffix]
    (folder / f"data{suffix}").write_bytes(data)
    return folder / f"data{suffix}", planted


@pytest.fixture(scope="module")
def clip(clips: dict[str, bytes]) -> bytes:
    return cut_clip(clips["bikes"], 8, width=48)


SETTINGS = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(drawn=metadata())
@example(drawn=(".csv", [("good", None), ("huge_field", None), ("caption_not_utf8", None), ("nul_video", None)]))
def test_each_bad_row_is_one_skipped_row_and_each_good_row_is_built(tmp_path_factory, tiny_model, clip, drawn):
    suffix, rows = drawn
    root = tmp_path_factory.mktemp("rows")
    path, planted = _write(root / "src", suffix, rows, clip)
    plan = make_plan(config(root, tiny_model, root / "out", source=f"meta:{path}", **GEOMETRY))
    for shard in plan.shards:
        result = process_shard(plan.job, shard)
        assert result.error is None, result.error
    found = {key: row for sid in ledger.shard_ids(plan.out) for key, row in ledger.read_shard(plan.out, sid).items()}
    assert {key: (row.status, row.reason) for key, row in found.items()} == {
        p.key: (p.status, p.reason) for p in planted
    }
    shutil.rmtree(root)


ATTACKS = {  # the four, each a row among good ones: (suffix, rows), the bad row's reason detail
    'meta row "audio": 5': ((".jsonl", [("good", None), ("audio", 5), ("good", None)]), "the audio path is a number"),
    "a NUL in a path": ((".jsonl", [("good", None), ("nul_video", None)]), "the video path holds a NUL"),
    "a CSV field over 128 KiB": ((".csv", [("huge_field", None), ("good", None)]), "field larger than field limit"),
    "100k-deep JSON": ((".json", [("good", None), ("deep", None), ("good", None)]), "nested deeper than the JSON"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_each_filed_row_attack_is_one_bad_row_and_the_others_are_read(tmp_path, clip, attack):
    """Before: TypeError, ValueError, csv.Error, RecursionError out of the listing, the run dead with Prefect's
    tracebacks. Now the source lists every row and the bad one reads as its ``bad_row`` reason."""
    (suffix, rows), detail = ATTACKS[attack]
    path, planted = _write(tmp_path / "src", suffix, rows, clip)
    source = open_source(f"meta:{path}")
    refs = [ref for shard in source.shards() for ref in source.samples(shard)]
    assert [ref.key for ref in refs] == [p.key for p in planted]
    for ref, p in zip(refs, planted, strict=True):
        if p.status == "done":
            assert read(ref).media == clip
        else:
            with pytest.raises(InputError) as caught:
                read(ref)
            assert caught.value.reason == "bad_row" and detail in caught.value.detail, caught.value


def test_a_build_over_the_filed_attacks_finishes_from_the_command_line(tmp_path, tiny_model, clip):
    """One jsonl holding ``"audio": 5``, a NUL in a path, a 100k-deep row and a line that is not JSON beside a good
    row: the build ends exit 0, the good row done and four bad_row rows (it died with Prefect's tracebacks, exit 1;
    the line that is not JSON stopped the run at its listing)."""
    rows = [("good", None), ("audio", 5), ("nul_video", None), ("deep", None), ("not_json", None)]
    path, planted = _write(tmp_path / "src", ".jsonl", rows, clip)
    out = tmp_path / "out"
    geometry = [f"--{k}={v}" for k, v in GEOMETRY.items()]
    args = ["build", "--source", f"meta:{path}", "--model", str(tiny_model), "--out", str(out), *geometry]
    args += ["--device", "cpu", "--dtype", "fp32", "--decode-samples", "0", "--on-loss", "accept"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "4 skipped" in result.output
    found = {key: row for rows in ledger.read_all(out).values() for key, row in rows.items()}
    assert {k: (r.status, r.reason) for k, r in found.items()} == {p.key: (p.status, p.reason) for p in planted}


@pytest.mark.parametrize(
    ("name", "data", "said"),
    [
        ("d.json", b'[{"video": "a.mp4", "caption": "x"} {"video": "b.mp4"}]', "expected ',' or ']' after row 1"),
        ("d.json", b'{"video": "a.mp4"}', "holds a list of objects"),
        ("d.json", b"{" * DEEP, "holds a list of objects"),
        ("d.csv", b'"video' + b"v" * CSV_FIELD + b'",caption\n', "the CSV header cannot be read"),
    ],
)
def test_a_metadata_file_that_cannot_be_told_into_rows_is_one_line_exit_2(tmp_path, tiny_model, name, data, said):
    (tmp_path / name).write_bytes(data)
    result = runner.invoke(
        app, ["build", "--source", f"meta:{tmp_path / name}", "--model", str(tiny_model), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert said in result.stderr and str(tmp_path / name) in result.stderr, result.stderr
    assert not (tmp_path / "o").exists()
