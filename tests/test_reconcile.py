"""Count reconciliation and the run report: hostile inputs, unprocessed shards, lost files, report files."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import infra.report_files
from flows.terminal_run import run_build
from infra.audit.reconcile import ReconcileReport, write_reconcile_report
from infra.audit.run_report import (
    HIDDEN_SETTINGS,
    ReportError,
    RunReport,
    latest_run_report,
    run_report,
    write_run_report,
)
from infra.cache import ledger
from infra.config import BuildConfig
from infra.gates.decision import Decision
from infra.plan import make_plan
from tests.conftest import GENERATORS, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.steps import reconciled

G0, G1 = GENERATORS
MAX_LENGTH = 512
LONG_PROMPT = "A cyclist in a red helmet waits at a crossing in city traffic behind a grey delivery van. " * 60


@pytest.fixture(scope="module")
def good(clips: dict[str, bytes]) -> bytes:
    """A quick real clip: the first 12 frames of bikes.mp4, 160 px wide."""
    return cut_clip(clips["bikes"], 12, width=160)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def _missing(report: ReconcileReport) -> dict[tuple[str, int], tuple[str | None, str]]:
    """(group, index) → (ledger status, reason) of every missing sample."""
    return {(m.group, int(m.id.rsplit("_", 1)[1])): (m.status, m.reason) for m in report.missing}


def _config(src: Path, model: Path, out: Path, **overrides: Any) -> BuildConfig:
    """The shared test config; a shortfall is accepted (the loss gate is not under test) and nothing decoded."""
    return config(src, model, out, **{"on_loss": "accept", "decode_samples": 0, **overrides})


def _counts(report: ReconcileReport) -> dict[str, tuple[int, int, int]]:
    return {group: (c.expected, c.produced, c.missing) for group, c in report.groups.items()}


Cases = dict[str, tuple[bytes | None, bytes | None]]


def _hostile(clips: dict[str, bytes], good: bytes) -> tuple[Cases, Cases]:
    """Expected reason → (video, prompt) for group 0 (bad videos) and group 1 (bad prompts, one long one)."""
    bigbuckbunny = clips["bigbuckbunny"]  # its moov box is at the end: a third of the file has no index
    zero: Cases = {
        "done": (good, b"A cyclist waits in traffic."),
        "video_decode_error": (bigbuckbunny[: len(bigbuckbunny) // 3], b"a truncated mp4"),
        "no_video_stream": (clips["audio_only"], b"only audio"),
        "empty_video": (b"", b"zero bytes"),
        "not_a_video": (_png(), b"a png named mp4"),
    }
    one: Cases = {
        "done": (good, b"A cyclist waits in traffic."),
        "missing_prompt": (good, None),
        "empty_prompt": (good, b" \n\t "),
        "prompt_not_utf8": (good, b"caf\xe9 \xff"),
        "truncated": (good, LONG_PROMPT.encode()),
    }
    return zero, one


def test_hostile_inputs_end_in_the_report_with_their_reasons(tmp_path, tiny_model, clips, good):
    zero, one = _hostile(clips, good)
    samples = [sample(0, i, *case) for i, case in enumerate(zero.values())]
    samples += [sample(1, i, *case) for i, case in enumerate(one.values())]
    src = make_shards(tmp_path / "src", {"hostile": samples})
    cfg = _config(src, tiny_model, tmp_path / "out")
    ok, result = run_build(cfg)
    assert ok, result

    report = reconciled(make_plan(cfg))
    assert _counts(report) == {G0: (5, 1, 4), G1: (5, 2, 3)}
    assert (report.expected, report.produced, report.shortfall, report.ok) == (10, 3, 7, False)
    expected = {(G0, i): ("skipped", r) for i, r in enumerate(zero) if r != "done"}
    expected |= {(G1, i): ("skipped", r) for i, r in enumerate(one) if r not in ("done", "truncated")}
    assert _missing(report) == expected
    assert all(m.detail and m.shard == "hostile" and m.key.endswith(m.id) for m in report.missing)
    assert report.reasons() == dict.fromkeys([r for _, r in expected.values()], 1)
    assert report.groups[G1].kinds == {"latents": 2, "text_embeddings": 2}

    (long,) = report.truncated
    assert (long.group, long.id.endswith("_00000004"), long.max_length) == (G1, True, MAX_LENGTH)
    assert long.tokens_total is not None and long.tokens_total > MAX_LENGTH
    row = ledger.read_shard(cfg.out, "hostile")[long.key]
    assert (row.status, row.truncated, row.tokens_total) == ("done", True, long.tokens_total)

    markdown, text = report.markdown(), report.text()
    assert "SHORTFALL 7" in markdown and "SHORTFALL 7" in text
    assert all(reason in markdown for reason in report.reasons())
    assert f"| {long.id} | {G1} | hostile | {long.key} | {long.tokens_total} | {MAX_LENGTH} |" in markdown
    assert report.table()[-1] == {
        "group": "total",
        "expected": 10,
        "produced": 3,
        "missing": 7,
        "produced latents": 3,
        "produced text_embeddings": 3,
    }


def test_an_unprocessed_shard_a_lost_file_and_a_lost_ledger(tmp_path, tiny_model, good):
    src = make_shards(tmp_path / "src", {"part-a": [sample(0, 0, good, b"zero"), sample(1, 0, good, b"one")]})
    out = tmp_path / "out"
    ok, result = run_build(_config(src, tiny_model, out))
    assert ok, result
    make_shards(src, {"part-b": [sample(1, 1, good, b"added after the build")]})
    rows = ledger.read_shard(out, "part-a")
    lost, resized = (rows[key] for key in sorted(rows))  # G-11 then O-21
    (out / str(lost.path)).unlink()

    report = reconciled(make_plan(_config(src, tiny_model, out)))
    assert _counts(report) == {G0: (1, 0, 1), G1: (2, 1, 1)}
    assert _missing(report) == {(G0, 0): ("done", "file_missing"), (G1, 1): (None, "not_processed")}
    by_reason = {m.reason: m for m in report.missing}
    assert str(lost.path) in str(by_reason["file_missing"].detail)
    assert by_reason["not_processed"].shard == "part-b" and "no ledger row" in str(by_reason["not_processed"].detail)

    with (out / str(resized.path)).open("ab") as fh:
        fh.write(b"\0")
    report = reconciled(make_plan(_config(src, tiny_model, out)))
    assert _missing(report)[(G1, 0)] == ("done", "file_size_mismatch")
    assert report.groups[G1].kinds == {"latents": 0, "text_embeddings": 0}

    ledger.sealed_path(out, "part-a").unlink()  # as if part-a had crashed before sealing
    report = reconciled(make_plan(_config(src, tiny_model, out)))
    assert set(_missing(report).values()) == {(None, "not_processed")}
    assert (report.expected, report.produced, report.shortfall) == (3, 0, 3)


def test_a_clean_cache_is_ok_and_the_selection_follows_the_quota(tmp_path, tiny_model, good):
    src = make_shards(
        tmp_path / "src", {"part": [sample(0, 0, good, b"a"), sample(1, 0, good, b"b"), sample(1, 1, good, b"c")]}
    )
    out = tmp_path / "out"
    capped = _config(src, tiny_model, out, max_samples_per_shard=2)
    ok, result = run_build(capped)
    assert ok, result

    report = reconciled(make_plan(capped))
    assert (report.ok, report.shortfall, report.expected, report.missing, report.truncated) == (True, 0, 2, [], [])
    assert _counts(report) == {G0: (1, 1, 0), G1: (1, 1, 0)}
    assert report.reasons() == {} and report.shard_problems == {} and report.unlisted == 0
    assert report.text().startswith("reconcile: OK (2 of 2")
    assert "### Missing samples" not in report.markdown()

    whole = reconciled(make_plan(_config(src, tiny_model, out)))
    assert (whole.expected, whole.shortfall) == (3, 1)
    assert _missing(whole) == {(G1, 1): (None, "not_processed")}
    narrower = reconciled(make_plan(_config(src, tiny_model, out, max_samples_per_shard=1)))
    assert (narrower.ok, narrower.expected, narrower.unlisted) == (True, 1, 1)


def test_a_damaged_shard_counts_what_it_lists_and_is_a_shard_problem(tmp_path, tiny_model, good):
    samples = [sample(0, i, good, f"clip {i}".encode()) for i in range(3)]
    src = make_shards(tmp_path / "src", {"cut": samples})
    tar = src / "cut.tar"
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size * 2 // 3])
    cfg = _config(src, tiny_model, tmp_path / "out")
    plan = make_plan(cfg)

    before = reconciled(plan)  # nothing built yet: every listed sample is not processed
    assert 0 < before.expected < len(samples) and before.expected == plan.shards[0].samples
    assert "tar damaged" in before.shard_problems["cut"]
    assert set(_missing(before).values()) == {(None, "not_processed")}

    ok, result = run_build(cfg)
    assert ok, result
    after = reconciled(make_plan(cfg))
    rows = ledger.read_shard(cfg.out, "cut")
    assert after.expected == before.expected and "tar damaged" in after.shard_problems["cut"]
    assert after.produced == sum(r.status == "done" for r in rows.values())
    assert {m.key: m.reason for m in after.missing} == {r.key: r.reason for r in rows.values() if r.status != "done"}


def test_report_files_are_never_overwritten(tmp_path, tiny_model, good, monkeypatch):
    src = make_shards(tmp_path / "src", {"part": [sample(0, 0, good, b"a")]})
    out = tmp_path / "out"
    report = reconciled(make_plan(_config(src, tiny_model, out)))  # nothing built: one sample not processed
    monkeypatch.setattr(infra.report_files, "utc_stamp", lambda now=None: "20250101T000000Z")
    first = write_reconcile_report(out, report)
    before = [p.read_bytes() for p in first]
    second = write_reconcile_report(out, report)
    assert [p.name for p in first] == ["reconcile-20250101T000000Z.json", "reconcile-20250101T000000Z.md"]
    assert [p.name for p in second] == ["reconcile-20250101T000000Z-2.json", "reconcile-20250101T000000Z-2.md"]
    assert [p.read_bytes() for p in first] == before
    assert json.loads(first[0].read_text()) == json.loads(json.dumps(report.to_dict()))
    assert json.loads(first[0].read_text())["reasons"] == {"not_processed": 1}
    assert "| not_processed | 1 |" in first[1].read_text()


def _report(n: int) -> RunReport:
    """A minimal run report, told apart by its flow run id."""
    model = {"path": "m", "family": "wan22", "identity": {}}
    return RunReport.model_validate(
        {
            "flow_run_id": str(n),
            "out": "o",
            "source": "vbvr:s",
            "model": model,
            "spec": {},
            "fingerprint": "f",
            "config": {},
            "shards": [],
            "counts": {},
            "reasons": {},
            "shard_errors": {},
            "timings": {},
            "reconciliation": None,
            "decode": None,
            "audio": None,
            "decisions": [],
            "versions": {},
        }
    )


def test_run_reports_one_per_run_and_the_newest_wins(tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert latest_run_report(out) is None
    paths = [write_run_report(out, _report(n)) for n in range(2)]  # the same second, most likely
    assert len(set(paths)) == 2 and latest_run_report(out).flow_run_id == "1"

    monkeypatch.setattr(infra.report_files, "utc_stamp", lambda now=None: "29991231T235959Z")
    same_second = [write_run_report(out, _report(n)) for n in range(2, 13)]
    assert [p.name for p in same_second[:3]] == [
        "run-29991231T235959Z.json",
        "run-29991231T235959Z-2.json",
        "run-29991231T235959Z-3.json",
    ]
    assert [json.loads(p.read_text())["flow_run_id"] for p in [*paths, *same_second]] == [str(n) for n in range(13)]
    assert latest_run_report(out).flow_run_id == "12"  # "-11" is newer than "-9" and than the unnumbered name
    assert len(list((out / "reports").glob("run-*.json"))) == 13


def test_a_run_report_with_an_unknown_or_missing_key_is_refused(tmp_path):
    out = tmp_path / "out"
    path = write_run_report(out, _report(1))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "surprise": 1}))
    with pytest.raises(ReportError, match="surprise"):
        latest_run_report(out)
    del data["reconciliation"]
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match="reconciliation"):
        latest_run_report(out)


def test_one_file_for_two_source_samples_counts_once(tmp_path, tiny_model, good):
    """The same group and id in two shards: the plan refuses the second (duplicate_id, naming the first), so the
    two never compete for one file. A run that sees only the second shard cannot know of the first: it adopts the
    first one's file, and reconciliation over both counts that one file once (duplicate_output)."""
    twin = [sample(0, 0, good, b"the same sample directory in two shards")]
    src = make_shards(tmp_path / "src", {"part-a": twin, "part-b": twin})
    cfg = _config(src, tiny_model, tmp_path / "out", workers=2)
    ok, result = run_build(cfg)
    assert ok, result
    assert result["done"] == 1 and result["reasons"] == {"duplicate_id": 1}
    report = reconciled(make_plan(cfg))
    assert _counts(report) == {G0: (2, 1, 1)}
    (duplicate,) = report.missing
    assert (duplicate.shard, duplicate.status, duplicate.reason) == ("part-b", "skipped", "duplicate_id")
    assert "part-a/" in str(duplicate.detail)

    ok, alone = run_build(cfg.with_values(shard_filter="part-b"))
    assert ok and alone["done"] == 1, alone  # both ledgers say done ...
    report = reconciled(make_plan(cfg))
    assert _counts(report) == {G0: (2, 1, 1)}  # ... but only one sample is in the cache
    (duplicate,) = report.missing
    assert (duplicate.shard, duplicate.status, duplicate.reason) == ("part-b", "done", "duplicate_output")
    assert "part-a" in str(duplicate.detail)


def test_the_run_report_holds_the_build_and_the_newest_is_found(tmp_path, tiny_model, good):
    src = make_shards(tmp_path / "src", {"part": [sample(0, 0, good, b"a"), sample(1, 0, good, b"b")]})
    out = tmp_path / "out"
    cfg = _config(src, tiny_model, out)
    ok, result = run_build(cfg)
    assert ok, result
    report = reconciled(make_plan(cfg))
    decisions = [Decision(gate="loss", choice="accept_loss", how="person", by="test", note="none lost")]
    plan = make_plan(cfg)
    data = run_report(
        plan.job,
        plan.shards,
        result,
        settings=plan.settings_record(HIDDEN_SETTINGS),
        reconciliation=report.to_dict(),
        decode=None,
        decisions=decisions,
        timings={"preprocess": 1.23456},
    )
    path = write_run_report(out, data)
    assert path.parent == out / "reports" and path.name.startswith("run-")
    loaded = latest_run_report(out)
    assert loaded == data
    assert loaded.counts["done"] == 2 and loaded.reconciliation is not None and loaded.reconciliation.ok
    assert loaded.fingerprint == result["fingerprint"] == loaded.reconciliation.fingerprint
    assert loaded.model.path == str(tiny_model) and loaded.timings == {"preprocess": 1.235}
    assert all(loaded.versions[name] for name in ("latentforge", "torch", "prefect"))
    assert "approve_overwrite" not in loaded.config
    written = set(RunReport.model_fields) - {"store_retries"}  # only a run that read a store counts its retries
    assert list(json.loads(path.read_text())) == sorted(written)
    assert loaded.decisions_at("loss")[0].by == "test"
