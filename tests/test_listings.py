"""How often a build lists its source: the source's shards once a build (the plan's), each shard's samples once in
the plan and once in its task (its prompt pass included), and the one shard the one-sample sanity reads its sample
from once more; the stale check, the sanity's projection and reconcile read what the plan listed.

The source is a real source kind registered the way a plugin registers one (`register_source`): VBVR's reader, with
each `shards()` and `samples(shard)` call counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from flows.terminal_run import run_build
from infra.cache import ledger
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
    cfg = config(source, tiny_model, tmp_path / "out", source=f"counted:{source}", text_offload=text_offload, workers=2)
    built, resumed = _listings(cfg), _listings(cfg)
    print("build:", dict(built), "resume:", dict(resumed))
    assert built["shards"] == 1 and resumed["shards"] == 1, (built, resumed)  # the plan's (reconcile reuses it)
    # the plan and the shard's task (its prompt pass too); the sanity lists the one shard it reads its sample from
    assert sorted(built[s] for s in SHARDS) == [2, 2, 3], built
    # the plan and the task: the stale check compares the plan's listing, the sanity finds nothing left from it
    assert [resumed[s] for s in SHARDS] == [2, 2, 2], resumed


@pytest.mark.parametrize(
    ("upset", "reasons"),
    [("delete", {"shard_vanished"}), ("truncate", {"shard_truncated", "shard_changed"})],  # as c800fb4 wrote them
)
def test_under_text_offload_a_shard_upset_mid_run_is_listed_again_and_a_row_per_planned_sample(
    tmp_path, tiny_model, clips, upset, reasons
):
    """The prompt pass holds the refs of its one listing only where the shard lists as planned; one deleted or cut
    since the plan is listed again, as before, and its planned samples get their rows."""
    from tests.test_accounting import (  # noqa: PLC0415 - the accounting tests' own helpers
        UPSETS,
        _assert_each_planned_sample_has_one_row,
        _listed_now,
        _source,
        _upset_mid_run,
    )

    src = _source(tmp_path / "src", cut_clip(clips["carphone"], 9, width=96), {"a": 2, "b": 2, "c": 2})
    cfg = config(src, tiny_model, tmp_path / "out", workers=1, text_offload=True)
    planned = _listed_now(cfg)
    ok, result = _upset_mid_run(cfg, 1, lambda: UPSETS[upset](src / "c.tar"), tmp_path)
    assert ok, result  # on_loss accept: the shortfall is recorded
    _assert_each_planned_sample_has_one_row(cfg.out, planned)
    assert {row.reason for row in ledger.read_shard(cfg.out, "c").values()} == reasons
    assert {row.status for s in ("a", "b") for row in ledger.read_shard(cfg.out, s).values()} == {"done"}
