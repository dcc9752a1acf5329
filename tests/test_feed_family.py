"""The feed bench's stand-in family (`bench/feed_family.py`): a build with it runs the real pipeline, its encoder
logs one busy interval per clip, and the busy fraction over the steady state is what the intervals say."""

from __future__ import annotations

import math

import pytest

from bench.feed_family import FeedFamily, busy_fraction, make_model, read_intervals
from flows.terminal_run import run_build
from infra.cache import ledger
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip

FAMILY = "bench.feed_family:FeedFamily"
LATENCY = 0.05
FRAMES, HEIGHT, WIDTH = 5, 32, 48


def test_busy_fraction_is_time_in_calls_over_the_steady_state():
    # the first call ends at 1 s; from there to the last end (4 s) the encoder is busy 2 s of 3
    assert busy_fraction([(2.0, 3.0), (0.0, 1.0), (3.0, 4.0)]) == pytest.approx(2 / 3)
    assert busy_fraction([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == pytest.approx(1.0)
    assert math.isnan(busy_fraction([(0.0, 1.0)]))


def test_a_build_with_the_stand_in_encoder_logs_each_clips_busy_interval(tmp_path, clips):
    videos = [cut_clip(clips[name], 8, width=96) for name in ("bikes", "carphone", "bigbuckbunny")]
    src = make_shards(tmp_path / "src", {"G-11_part-00000": [sample(0, i, v, b"a clip") for i, v in enumerate(videos)]})
    log = tmp_path / "busy.log"
    model = make_model(tmp_path / "model", LATENCY, log)
    cfg = config(src, model, tmp_path / "out", family=FAMILY, frames=FRAMES, height=HEIGHT, width=WIDTH, workers=1)
    ok, result = run_build(cfg)
    assert ok, result
    assert result["done"] == len(videos)
    rows = ledger.read_shard(tmp_path / "out", "G-11_part-00000")
    assert {row.status for row in rows.values()} == {"done"}
    intervals = read_intervals(log)
    assert len(intervals) >= len(videos) + 1  # the one-sample sanity's encode(s), then the shard's
    assert all(end - start >= LATENCY for start, end in intervals)
    busy = busy_fraction(intervals[-len(videos) :])
    assert 0 < busy <= 1
    shape = FeedFamily().latent_shape(model, FRAMES, HEIGHT, WIDTH)
    assert shape == (3, FRAMES, HEIGHT // 8, WIDTH // 8)
