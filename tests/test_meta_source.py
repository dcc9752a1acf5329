"""Metadata-file sources (`meta:`): the LTX-2 trainer's csv/json/jsonl columns and FastVideo's videos2caption.json,
ids relative to the file's directory, a missing file as a ledger row, output-name collisions refused at plan time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.errors import ConfigError, InputError, SourceError
from infra.media.buckets import Bucket, choose_bucket, parse_buckets
from infra.plan import make_plan
from infra.sources import Problem, open_source
from tests.conftest import config


def _refs(spec: str) -> list:
    source = open_source(spec)
    return [ref for shard in source.shards() for ref in source.samples(shard)]


def _media(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"not decoded here: " + name.encode())


@pytest.mark.parametrize("kind", ["csv", "json", "jsonl", "fastvideo"])
def test_every_listing_gives_the_same_samples(tmp_path, kind):
    _media(tmp_path, "clips/a.mp4", "clips/deep/b.mp4", "top.mp4")
    rows = [("clips/a.mp4", "a cat"), ("clips/deep/b.mp4", "a dog"), ("top.mp4", "a bird"), ("gone.mp4", "a fox")]
    path = (
        tmp_path
        / {"csv": "data.csv", "json": "data.json", "jsonl": "data.jsonl", "fastvideo": "videos2caption.json"}[kind]
    )
    if kind == "csv":
        path.write_text("video,caption\n" + "".join(f"{v},{c}\n" for v, c in rows))
    elif kind == "json":
        path.write_text(json.dumps([{"media_path": v, "caption": c} for v, c in rows]))  # the legacy column name
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({"video": v, "caption": c}) + "\n" for v, c in rows))
    else:
        path.write_text(json.dumps([{"path": v, "cap": [c, "another caption"]} for v, c in rows]))
    refs = _refs(f"meta:{path}")
    assert [r.id for r in refs] == ["clips/a.mp4", "clips/deep/b.mp4", "top.mp4", "gone.mp4"]
    assert [r.stem for r in refs] == ["clips/a", "clips/deep/b", "top", "gone"]
    assert [r.group for r in refs] == ["clips", "clips", "root", "root"]
    assert [r.read_prompt().decode() for r in refs] == ["a cat", "a dog", "a bird", "a fox"]
    assert refs[0].read_media() == b"not decoded here: clips/a.mp4"
    assert refs[3].read_media() is None  # missing: a ledger row (missing_video), not an abort
    assert set(refs[0].identity.members) == {"video", "caption"} and set(refs[3].identity.members) == {"caption"}


def test_unsafe_paths_and_repeated_rows_are_layout_errors(tmp_path):
    _media(tmp_path, "a.mp4")
    path = tmp_path / "d.jsonl"
    rows = [
        {"video": "a.mp4", "caption": "x"},
        {"video": "../outside.mp4", "caption": "y"},
        {"video": "a.mp4", "caption": "z"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    good, outside, twice = _refs(f"meta:{path}")
    assert good.problem is None and good.stem == "a"
    assert "cannot name an output" in outside.problems[Problem.BAD_LAYOUT] and outside.stem == ""
    assert "listed twice" in twice.problems[Problem.BAD_LAYOUT] and twice.key != good.key


def test_a_bad_metadata_file_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match=r"expected a \.csv"):
        open_source(f"meta:{tmp_path / 'x.txt'}")
    with pytest.raises(SourceError, match="no such file"):
        open_source(f"meta:{tmp_path / 'x.json'}").shards()
    (tmp_path / "obj.json").write_text('{"video": "a.mp4"}')
    with pytest.raises(SourceError, match="list of objects"):
        open_source(f"meta:{tmp_path / 'obj.json'}").shards()
    (tmp_path / "cols.csv").write_text("file,text\na.mp4,x\n")
    with pytest.raises(SourceError, match="no video column"):
        open_source(f"meta:{tmp_path / 'cols.csv'}").shards()


def test_two_media_files_with_one_output_name_are_refused_at_plan_time(tmp_path, ltx2_model):
    """The LTX-2 trainer would overwrite one of them silently: the plan keeps the first and refuses the second
    (name_collision, naming the first), as it refuses a duplicate id."""
    _media(tmp_path, "clips/a.mp4", "clips/a.mov")
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps([{"video": "clips/a.mp4", "caption": "x"}, {"video": "clips/a.mov", "caption": "y"}]))
    cfg = config(
        tmp_path, ltx2_model, tmp_path / "out", source=f"meta:{path}", format="ltx", frames=9, height=64, width=96
    )
    (shard,) = make_plan(cfg).shards
    assert list(shard.collisions) == ["clips/a.mov"] and "'clips/a.mp4'" in shard.collisions["clips/a.mov"]
    first, second = open_source(f"meta:{path}").samples(shard.shard)
    assert first.stem == "clips/a" and first.problem is None
    assert second.stem == "" and "'clips/a.mov'" in second.problems[Problem.NAME_COLLISION]


def test_bucket_strings_and_the_trainers_choice():
    assert parse_buckets("96x64x9; 64x64x17 ;64X96X1") == [Bucket(96, 64, 9), Bucket(64, 64, 17), Bucket(64, 96, 1)]
    for bad, named in (("96x64", "'96x64'"), ("96x64x9;axbxc", "'axbxc'"), ("96x0x9", "zero"), (";", "no bucket"),
                       ("96x64x9;96x64x9", "twice")):  # fmt: skip
        with pytest.raises(ConfigError, match=named):
            parse_buckets(bad)
    buckets = parse_buckets("96x64x17;64x64x17;64x96x17;96x64x9")
    assert choose_bucket(buckets, 30, 720, 1280) == Bucket(96, 64, 17)  # landscape: the 3:2 bucket, most frames
    assert choose_bucket(buckets, 12, 720, 1280) == Bucket(96, 64, 9)  # only the 9-frame bucket fits 12 frames
    assert choose_bucket(buckets, 30, 144, 176) == Bucket(64, 64, 17)  # 176x144 (1.22) is nearer square than 3:2
    assert choose_bucket(buckets, 30, 1280, 720) == Bucket(64, 96, 17)  # portrait
    with pytest.raises(InputError, match=r"decodes to 5 frame\(s\); the shortest bucket, 96x64x9, needs 9") as info:
        choose_bucket(buckets, 5, 720, 1280)
    assert info.value.reason == "too_short_for_buckets"
