"""Alerts on a real Prefect server: a failed run, a run waiting for approval, a notification block —
each delivered to a loopback HTTP receiver with the run's name, the step and the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.terminal_run import run_build
from infra.config import AlertConfig
from infra.ops.alerts import Alert, destinations, post_webhook
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.pauses import wait_pending
from tests.receiver import receiver

LF = str(Path(sys.executable).with_name("latentforge"))

FAILING_BUILD = """
import sys
from flows.terminal_run import run_build
from infra.config import BuildConfig
config = BuildConfig.model_validate_json(sys.argv[1])
ok, result = run_build(config)
print(result)
raise SystemExit(0 if ok else 1)
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_model, clips) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("alerts")
    src = make_shards(root / "src", {"s": [sample(0, 0, cut_clip(clips["carphone"], 9), b"a phone call")]})
    ok, result = run_build(config(src, tiny_model, root / "cache"))
    assert ok and result["done"] == 1, result
    return src, root / "cache"


def test_a_failed_run_alerts_with_its_name_step_and_reason(small, prefect_server, tmp_path):
    src, _ = small
    with receiver() as hook:
        bad = config(src, tmp_path / "no-such-model", tmp_path / "out", alerts={"webhook": hook.url})
        env = {k: v for k, v in prefect_server.items() if k != "LATENTFORGE_ALERT_WEBHOOK"}
        done = subprocess.run(
            [sys.executable, "-c", FAILING_BUILD, bad.model_dump_json()], env=env, capture_output=True, text=True
        )
        assert done.returncode == 1, done.stdout + done.stderr
        alert = hook.wait_for(lambda body: isinstance(body, dict) and body.get("kind") == "failed")
    assert alert["flow"] == "build-cache" and alert["step"] == "plan"
    assert "no-such-model" in alert["reason"]
    assert alert["run_name"] and alert["run_name"] in alert["text"]
    assert alert["url"].startswith(prefect_server["PREFECT_API_URL"].removesuffix("/api"))
    assert alert["url"].endswith(f"/runs/flow-run/{alert['run_id']}")
    assert not (tmp_path / "out").exists()


def test_a_paused_run_alerts_then_is_answered_from_another_process(small, tiny_model, prefect_server, tmp_path):
    """The approvals' abort path too: answered `abort` from another process, the build exits 1 and the existing
    cache is byte for byte what it was."""
    src, cache = small
    out = tmp_path / "out"
    shutil.copytree(cache, out)
    before = tree_hashes(out)
    with receiver() as hook:
        env = {**prefect_server, "LATENTFORGE_ALERT_WEBHOOK": hook.url}
        args = [LF, "build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(out)]
        args += ["--device", "cpu", "--dtype", "fp32", "--frames", str(FRAMES + 4), "--height", str(HEIGHT)]
        args += ["--width", str(WIDTH), "--on-conflict", "ask", "--approval-timeout", "120", "--decode-samples", "0"]
        build = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            paused = hook.wait_for(lambda body: isinstance(body, dict) and body.get("kind") == "paused", timeout=120)
            assert paused["step"] == "conflict" and "incompatible" in paused["reason"]
            assert f"latentforge approve {paused['run_id']}" in paused["reason"]
            wait_pending(prefect_server["PREFECT_API_URL"], match=lambda run: run.id == paused["run_id"], wait_s=60)
            answer = subprocess.run(
                [LF, "approve", paused["run_id"], "abort", "--by", "ops"], env=env, text=True, capture_output=True
            )
            assert answer.returncode == 0, answer.stderr
            output, _ = build.communicate(timeout=120)
        finally:
            if build.poll() is None:
                build.kill()
        assert build.returncode == 1 and "decided: abort by ops" in output, output
        failed = hook.wait_for(lambda body: isinstance(body, dict) and body.get("kind") == "failed")
    assert failed["run_id"] == paused["run_id"] and failed["step"] == "conflict-gate"
    assert "ConflictAborted" in failed["reason"] and "holds another cache" in failed["reason"]
    assert tree_hashes(out) == before


def test_a_notification_block_named_in_config_gets_the_alert(small, prefect_server, tmp_path):
    src, _ = small
    with receiver() as hook:
        with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
            CustomWebhookNotificationBlock(
                name="latentforge-test",
                url=hook.url,
                json_data={"subject": "{{subject}}", "body": "{{body}}"},
                allow_private_urls=True,
            ).save("lf-test-alerts", overwrite=True)
        bad = config(
            src, tmp_path / "missing-model", tmp_path / "out", alerts={"block": "custom-webhook/lf-test-alerts"}
        )
        done = subprocess.run(
            [sys.executable, "-c", FAILING_BUILD, bad.model_dump_json()],
            env=prefect_server,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1, done.stdout + done.stderr
        got = hook.wait_for(lambda body: isinstance(body, dict) and "FAILED at plan" in body.get("subject", ""))
    assert "missing-model" in got["body"]


def test_the_webhook_url_stays_out_of_the_run_report(small, tiny_model, tmp_path):
    src, _ = small
    secret = "http://127.0.0.1:9/hooks/T000/B000/s3cr3t-token"
    ok, result = run_build(config(src, tiny_model, tmp_path / "out", alerts={"webhook": secret}))
    assert ok, result
    report = Path(result["run_report"]).read_text()
    assert "s3cr3t-token" not in report and json.loads(report)["config"]["alerts"] == {"block": None}


def test_destinations_prefer_config_and_delivery_never_raises(monkeypatch):
    monkeypatch.setenv("LATENTFORGE_ALERT_WEBHOOK", "http://127.0.0.1:9/env")
    assert destinations(None).webhook == "http://127.0.0.1:9/env"
    assert destinations(AlertConfig(webhook="http://127.0.0.1:9/cfg")).webhook == "http://127.0.0.1:9/cfg"
    monkeypatch.delenv("LATENTFORGE_ALERT_WEBHOOK")
    assert not destinations(None)
    alert = Alert("failed", "build-cache", "run", "id", "plan", "why", None)
    closed_port = "http://127.0.0.1:9/nothing-listens"  # port 9 (discard) is closed here
    assert post_webhook(closed_port, alert) is False
