"""A sample is blamed only on proof (`infra.preprocess.inflight`): a sample in flight when a run died (its mark with
no row after it), or recorded ``killed_run`` by a latentforge before this rule, is a suspect: decoded alone in a child
process (`infra.preprocess.alone`), to the bytes of a build where nothing died. Only that child dying on it, twice,
fails it, with the child's signal as the proof; the same command leaves it failed, `rerun --failed-only` tries it
again."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.ledger import LedgerRow
from infra.faults import ENV, KILL_ON_ENV, LOG_ENV
from infra.plan import make_plan
from infra.preprocess.alone import STARTING_POINT, SUSPECT_POINT, ChildKilled, prepare_alone
from infra.preprocess.inflight import KILLED_RUN, PROOF
from infra.preprocess.prepare import prepare
from infra.preprocess.read import RawSample
from infra.preprocess.shard import process_shard
from infra.sources import SampleRef
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip

runner = CliRunner()
SHARD = "s"
SAMPLES = 5
#: A ``killed_run`` row as latentforge wrote it before a child's death was the proof: two deaths of the whole process.
OLD_DETAIL = (
    "in progress when 2 runs died (processes 101, 102): an out-of-memory kill, a decoder crash or a SIGKILL; not tried "
    "again. To try it again: latentforge rerun RUN_ID --failed-only, or --only SHARD/KEY"
)


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips[name], 9, width=96) for name in ("bikes", "carphone", "bigbuckbunny")]
    samples = [sample(i % 2, i, videos[i % 3], f"clip {i} moves".encode()) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("suspects-src"), {SHARD: samples})


@pytest.fixture(scope="module")
def reference(source, tiny_model, tmp_path_factory) -> Path:
    """The same shard built where nothing died."""
    out = tmp_path_factory.mktemp("suspects-ref") / "out"
    plan = make_plan(config(source, tiny_model, out, workers=1))
    assert process_shard(plan.job, plan.shards[0]).counts == {"done": SAMPLES}
    return out


def _facts(out: Path) -> dict[str, tuple]:
    return {k: (r.status, r.reason, r.path, r.bytes, r.sha256) for k, r in ledger.read_shard(out, SHARD).items()}


def _files(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(out).items() if k.endswith(".pt")}


def _old_killed_row(row: LedgerRow) -> LedgerRow:
    return row.model_copy(update={"status": "failed", "reason": KILLED_RUN, "detail": OLD_DETAIL, "path": None})


def test_suspects_and_old_killed_run_rows_are_decoded_alone_to_the_bytes_of_an_unbroken_build(
    source, tiny_model, reference, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    plan = make_plan(config(source, tiny_model, out, workers=1))
    process_shard(plan.job, plan.shards[0])
    rows = ledger.read_shard(out, SHARD)
    keys = sorted(rows)
    # what runs killed from outside leave: two samples in flight (marks, no row after them, no file), and a third one
    # recorded killed_run by the rule before this one (no child's death in its row)
    sealed = [row for key, row in rows.items() if key not in keys[:3]]
    ledger.seal(out, SHARD, sealed)
    for key in keys[:3]:
        (out / rows[key].path).unlink()
    with ledger.open_journal(out, SHARD) as journal:
        journal.mark(keys[0], alone=False)
        journal.mark(keys[1], alone=False)
        journal.append(_old_killed_row(rows[keys[2]]))
        journal.mark(keys[1], alone=True)  # in flight at a second death too: still no proof
    points = tmp_path / "points.log"
    monkeypatch.setenv(LOG_ENV, str(points))  # the children inherit it: each logs the point it reaches
    result = process_shard(plan.job, plan.shards[0])
    assert result.counts == {"done": SAMPLES}, result
    assert points.read_text().split().count(SUSPECT_POINT) == 3  # each suspect decoded in a child of its own
    assert _facts(out) == _facts(reference) and _files(out) == _files(reference)


def test_a_child_decodes_to_the_bytes_of_this_process_and_its_death_is_the_proof(
    source, tiny_model, clips, tmp_path, monkeypatch
):
    plan = make_plan(config(source, tiny_model, tmp_path / "out"))
    ref = SampleRef(id="1", group="g", key="g/1", read_media=lambda: None, read_prompt=lambda: None)
    raw = RawSample(ref, "p", cut_clip(clips["carphone"], 9, width=96))
    alone, here = prepare_alone(raw, plan.job), prepare(raw, plan.job)
    assert alone.video.pixels.equal(here.video.pixels) and alone.sampling == here.sampling
    monkeypatch.setenv(KILL_ON_ENV, f"{SUSPECT_POINT}:SIGSEGV=g/1")  # a decoder crash on this sample's bytes
    with pytest.raises(ChildKilled) as killed:
        prepare_alone(raw, plan.job)
    assert killed.value.signal == "SIGSEGV" and len(killed.value.deaths) == 2
    assert [d["exitcode"] for d in killed.value.evidence()["deaths"]] == [-signal.SIGSEGV] * 2
    monkeypatch.setenv(ENV, STARTING_POINT)  # every child killed before it is ready: no proof against the sample
    with pytest.raises(RuntimeError, match="not on it") as failed:
        prepare_alone(raw, plan.job)
    assert not isinstance(failed.value, ChildKilled) and "SIGKILL before it was ready" in str(failed.value)


@pytest.mark.slow
def test_a_sample_that_kills_its_child_twice_is_failed_with_the_signal_and_rerun_failed_only_tries_it_again(
    source, tiny_model, reference, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    ok, first = run_build(config(source, tiny_model, out, workers=1))
    assert ok and first["done"] == SAMPLES, first
    rows = ledger.read_shard(out, SHARD)
    bad = sorted(rows)[1]
    with ledger.open_journal(out, SHARD) as journal:  # the process died with it in flight: a suspect
        journal.mark(bad, alone=True)
    (out / rows[bad].path).unlink()
    monkeypatch.setenv(KILL_ON_ENV, f"{SUSPECT_POINT}={bad}")  # every child that decodes it is SIGKILLed
    points = tmp_path / "points.log"
    monkeypatch.setenv(LOG_ENV, str(points))
    ok, second = run_build(config(source, tiny_model, out, workers=1, on_loss="abort"))
    assert not ok and "LossAborted" in second, second
    assert "fix what the reasons name" not in second and "--failed-only" in second, second
    row = ledger.read_shard(out, SHARD)[bad]
    assert (row.status, row.reason, row.extra[PROOF]["signal"]) == ("failed", KILLED_RUN, "SIGKILL"), row
    assert "SIGKILL" in row.detail and "--failed-only" in row.detail, row.detail
    assert len(row.extra[PROOF]["deaths"]) == 2 and points.read_text().split().count(SUSPECT_POINT) == 2
    assert all(r.status == "done" for k, r in ledger.read_shard(out, SHARD).items() if k != bad)

    points.unlink()
    ok, third = run_build(config(source, tiny_model, out, workers=1))  # the same command: not tried again
    assert ok and third["failed"] == 1, third
    assert not points.exists() or SUSPECT_POINT not in points.read_text().split()
    run_id = json.loads(Path(third["run_report"]).read_text())["flow_run_id"]
    assert ledger.read_shard(out, SHARD)[bad].extra["run_id"] == run_id  # so its rerun selects it

    monkeypatch.delenv(KILL_ON_ENV)  # its bytes fixed (a decoder that no longer crashes on them)
    rerun = runner.invoke(app, ["rerun", run_id, "--failed-only"])
    assert rerun.exit_code == 0, rerun.output[-3000:]
    assert SUSPECT_POINT in points.read_text().split()  # tried again on purpose, alone in a child again
    assert _facts(out) == _facts(reference) and _files(out) == _files(reference)
