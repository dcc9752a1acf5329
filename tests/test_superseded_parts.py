"""An approved stale replacement in a shard format leaves no duplicate a plain reader can see: the re-encoded copy
goes into a new part and the old part is rewritten without the old copy, so webdataset's reader and FastVideo's
parquet reader (pyarrow over every part) see each sample once; the part records and ``_meta.json`` follow."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset

from flows.terminal_run import run_build
from infra.formats.stream import stream_samples
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip

PROMPTS = (b"a cyclist", b"a man on the phone", b"a rabbit")


def _source(root: Path, videos: list[bytes], prompts: tuple[bytes, ...]) -> Path:
    return make_shards(root, {"a": [sample(0, i, videos[i], prompts[i]) for i in range(3)]})


def _keys(out: Path, fmt: str) -> Counter[str]:
    """Every sample key a plain reader of the parts sees (no ledger, no latentforge)."""
    parts = sorted(str(p) for p in (out / "shards").iterdir() if not p.name.startswith("."))
    if fmt == "webdataset":
        return Counter(s["__key__"] for s in webdataset.WebDataset(parts, shardshuffle=False))
    return Counter(row for part in parts for row in pq.read_table(part, columns=["id"])["id"].to_pylist())


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_an_approved_replacement_rewrites_the_old_part_without_the_old_copy(clips, tiny_model, tmp_path, fmt):
    videos = [cut_clip(clips[name], 9, width=160) for name in ("bikes", "carphone", "bigbuckbunny")]
    src = _source(tmp_path / "src", videos, PROMPTS)
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out, format=fmt, shard_samples=2))
    assert ok and result["done"] == 3, result
    before = _keys(out, fmt)
    assert len(before) == 3 and set(before.values()) == {1}
    (src / "a.tar").unlink()
    _source(src, videos, (b"a cyclist in the rain", *PROMPTS[1:]))  # an upstream revision of one prompt
    ok, result = run_build(config(src, tiny_model, out, format=fmt, shard_samples=2, on_stale="replace"))
    assert ok and result["encoded"] == 1 and result["reused"] == 2, result
    after = _keys(out, fmt)
    assert after == before  # each sample once, to webdataset's and pyarrow's readers alike
    parts = sorted(p.name for p in (out / "shards").iterdir() if not p.name.startswith("."))
    assert len(parts) == 3  # the new copy in a part of its own; the old part rewritten in place
    meta = json.loads((out / "_meta.json").read_text())
    assert meta["samples"] == 3 and [s["samples"] for s in meta["shards"]] == [1, 1, 1]
    for entry in meta["shards"]:
        record = json.loads((out / "ledger" / "parts" / f"{Path(entry['url']).name}.json").read_text())
        digest = hashlib.sha256((out / entry["url"]).read_bytes()).hexdigest()
        assert entry["sha256"] == record["sha256"] == digest and len(record["members"]) == record["samples"]
    streamed = [s["prompt"] for s in stream_samples(out)]
    assert sorted(streamed) == sorted(p.decode() for p in (b"a cyclist in the rain", *PROMPTS[1:]))
