"""Shard formats (webdataset, parquet) end to end: real builds of the tiny Wan2.2 and LTX-2 models, read back
through latentforge's readers and through the libraries trainers use (webdataset, pyarrow, `datasets`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.run import run_build
from infra.cache import ledger
from infra.formats import get_format
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip

FORMATS = ("webdataset", "parquet")
#: Samples per shard file: 3 samples per source shard make two parts, the second one short.
PER_PART = 2
LTX2_GEOMETRY = {"frames": 9, "height": 64, "width": 96}


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips[name], 10, width=160) for name in ("bikes", "carphone", "bigbuckbunny")]
    shard_a = [sample(0, i, videos[i], f"clip {i} of group zero".encode()) for i in range(3)]
    shard_b = [sample(1, i, videos[2 - i], f"clip {i} of group one".encode()) for i in range(3)]
    return make_shards(tmp_path_factory.mktemp("shards-src"), {"shard-a": shard_a, "shard-b": shard_b})


def _config(src: Path, model: Path, out: Path, fmt: str, family: str, **overrides: object):
    geometry = LTX2_GEOMETRY if family == "ltx2" else {}
    return config(src, model, out, format=fmt, shard_samples=PER_PART, **geometry, **overrides)


@pytest.fixture(scope="module")
def built(request, source, tiny_model, ltx2_model, tmp_path_factory) -> dict[tuple[str, str], Path]:
    return {}


def _build(built, source, models, tmp_path_factory, fmt: str, family: str) -> Path:
    if (fmt, family) not in built:
        out = tmp_path_factory.mktemp(f"{fmt}-{family}") / "out"
        ok, result = run_build(_config(source, models[family], out, fmt, family))
        assert ok, result
        built[(fmt, family)] = out
    return built[(fmt, family)]


@pytest.mark.parametrize("family", ["wan22", "ltx2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip(built, source, tiny_model, ltx2_model, tmp_path_factory, fmt, family):
    out = _build(built, source, {"wan22": tiny_model, "ltx2": ltx2_model}, tmp_path_factory, fmt, family)
    names = sorted(p.name for p in (out / "shards").iterdir())
    print(names)
    rows = [r for rows in ledger.read_all(out).values() for r in rows.values()]
    assert all(r.status == "done" for r in rows) and len(rows) == 6
