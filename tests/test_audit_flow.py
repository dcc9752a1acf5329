"""The audit steps inside the build flow: the loss gate (abort / accept / ask), decode-and-verify, the run report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.pauses import wait_pending

LF = str(Path(sys.executable).with_name("latentforge"))


@pytest.fixture(scope="module")
def lossy_source(tmp_path_factory, clips) -> Path:
    """Two good samples and two that cannot be encoded (no video stream, blank prompt)."""
    good = cut_clip(clips["carphone"], 9)
    samples = [
        sample(0, 0, good, b"a man talks in a car"),
        sample(0, 1, clips["audio_only"], b"only audio"),
        sample(1, 2, good, b"   "),
        sample(1, 3, cut_clip(clips["bikes"], 9, width=160), b"cyclists in traffic"),
    ]
    return make_shards(tmp_path_factory.mktemp("lossy") / "src", {"s": samples})


def test_on_loss_abort_exits_non_zero_and_still_writes_the_run_report(tmp_path, tiny_model, lossy_source):
    out = tmp_path / "out"
    args = [LF, "build", "--source", f"vbvr:{lossy_source}", "--model", str(tiny_model), "--out", str(out)]
    args += ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu"]
    args += ["--on-loss", "abort", "--decode-samples", "0"]
    done = CliRunner().invoke(app, args[1:])  # in this process, on the session's Prefect API
    assert done.exit_code == 1, done.output
    assert "2 sample(s) missing" in done.stderr, done.output
    report = latest_run_report(out)
    assert report is not None
    (decision,) = report.decisions
    assert (decision.gate, decision.choice, decision.how, decision.by) == ("loss", "abort", "policy", "on_loss=abort")
    assert decision.details["shortfall"] == 2 and report.reconciliation.shortfall == 2


def test_on_loss_accept_finishes_decodes_and_records_the_decision(tmp_path, tiny_model, lossy_source):
    out = tmp_path / "out"
    ok, result = run_build(config(lossy_source, tiny_model, out, on_loss="accept", decode_samples=2))
    assert ok, result
    assert result["decisions"][0]["choice"] == "accept_loss"
    report = json.loads(Path(result["run_report"]).read_text())
    assert report["decisions"][0]["by"] == "on_loss=accept" and report["decisions"][0]["how"] == "policy"
    assert report["fingerprint"] == result["fingerprint"]
    assert report["reconciliation"]["shortfall"] == 2
    reasons = report["reconciliation"]["missing"]
    assert sorted(m["reason"] for m in reasons) == ["empty_prompt", "no_video_stream"]
    decoded = report["decode"]["rows"]
    assert len(decoded) == 2 and all(row["psnr"] is not None for row in decoded)
    assert all(Path(row["mp4"]).is_file() and Path(row["png"]).is_file() for row in decoded)
    assert sorted(p.name for p in (out / "reports").glob("run-*.json")) == [Path(result["run_report"]).name]
    artifacts = _artifacts(report["flow_run_id"])  # what the UI shows, read back from the session's Prefect API
    assert "**accept_loss**" in artifacts["loss-decision"] and "on_loss=accept" in artifacts["loss-decision"]
    for key in ("loss-decision", "reconciliation-missing"):  # which samples are missing, and why
        listed = artifacts[key]
        assert "| sample | reason | detail |" in listed, listed
        assert "| no_video_stream |" in listed and "| empty_prompt |" in listed
        assert all(f"{m['group']}/{m['id']}" in listed for m in reasons)


def _artifacts(run_id: str) -> dict[str, str]:
    """Key → data of every artifact of the flow run, through the Prefect API."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}))
    return {a.key: str(a.data) for a in found if a.key}


@pytest.mark.soak  # ~30 s; the same pause and `latentforge approve` path is tested at the conflict gate
def test_the_loss_gate_asks_and_is_answered_from_another_process(tmp_path, tiny_model, lossy_source, prefect_server):
    out = tmp_path / "out"
    args = [LF, "build", "--source", f"vbvr:{lossy_source}", "--model", str(tiny_model), "--out", str(out)]
    args += ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu"]
    args += ["--decode-samples", "0"]
    build = subprocess.Popen(args, env=prefect_server, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    paused = wait_pending(prefect_server["PREFECT_API_URL"], build=build)  # at the loss gate
    run_id = paused.id
    assert "no_video_stream" in paused.preview and "empty_prompt" in paused.preview
    answer = [LF, "approve", run_id, "accept_loss", "--by", "qa-lead", "--note", "two broken clips"]
    assert subprocess.run(answer, env=prefect_server, capture_output=True, text=True).returncode == 0
    stdout, stderr = build.communicate(timeout=300)
    assert build.returncode == 0, stdout + stderr
    (decision,) = latest_run_report(out).decisions
    assert (decision.gate, decision.choice, decision.how) == ("loss", "accept_loss", "person")
    assert (decision.by, decision.note) == ("qa-lead", "two broken clips")
