"""How often a build lists its source: the source's shards once a build, each shard's samples once a step that
needs them (the plan, the shard's task; the one-sample sanity the shard it reads its sample from), not once a step.

The source is a real source kind registered the way a plugin registers one (`register_source`): VBVR's reader, with
each `shards()` and `samples(shard)` call counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from flows.run import run_build
from infra.sources import SampleRef, Shard
from infra.sources.base import register_source
from infra.sources.vbvr import VbvrSource
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip

#: Every call since `_reset`: "shards", and each shard id for its `samples`.
CALLS: Counter[str] = Counter()


@register_source("counted")
class CountedSource(VbvrSource):
    """VBVR tars, each listing counted in `CALLS`."""

    def shards(self) -> list[Shard]:
        CALLS["shards"] += 1
        return super().shards()

    def samples(self, shard: Shard) -> Iterator[SampleRef]:
        CALLS[shard.id] += 1
        return super().samples(shard)


SHARDS = ("G-11_part-00000", "O-21_part-00000", "O-21_part-00001")


@pytest.fixture
def source(tmp_path, clips):
    """Three shards of two short real clips each."""
    videos = [cut_clip(clips["bikes"], 12, width=160), cut_clip(clips["carphone"], 12)]
    return make_shards(
        tmp_path / "src",
        {
            name: [sample(s % 2, 10 * s + i, v, f"clip {i} of shard {s}".encode()) for i, v in enumerate(videos)]
            for s, name in enumerate(SHARDS)
        },
    )


def _listings(cfg) -> Counter[str]:
    CALLS.clear()
    ok, result = run_build(cfg)
    assert ok, result
    return Counter(CALLS)


@pytest.mark.parametrize("text_offload", [False, True])
def test_a_build_and_its_resume_list_each_shard_once_a_step(tmp_path, tiny_model, source, text_offload):
    cfg = config(source, tiny_model, tmp_path / "out", source=f"counted:{source}", text_offload=text_offload)
    built, resumed = _listings(cfg), _listings(cfg)
    print("build:", dict(built), "resume:", dict(resumed))
    assert built["shards"] == 1 and resumed["shards"] == 1, (built, resumed)  # the plan's (reconcile reuses it)
    per_shard = [built[s] for s in SHARDS]
    assert max(per_shard) <= 3 and sum(per_shard) <= 2 * len(SHARDS) + 1, built  # plan, task; sanity's one shard
    per_shard = [resumed[s] for s in SHARDS]
    assert max(per_shard) <= 3 and sum(per_shard) <= 3 * len(SHARDS), resumed  # plan, stale check, task
