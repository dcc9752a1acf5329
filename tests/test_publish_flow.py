"""The upload as a step of the build and its gates, through the public interfaces, against a moto S3 server:
the build uploads only after its gates pass, a gate that failed stops `latentforge upload` unless
`--skip-gates` (recorded), and a changed remote object is replaced only with the token bound to it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from tests import s3_server
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip
from tests.receiver import receiver

moto_server, s3_env = s3_server.moto_server, s3_server.s3_env  # the fixtures, by name
runner = CliRunner()


@pytest.fixture
def bucket(s3_env: str) -> str:
    name = f"lf-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def source(tmp_path_factory, clips) -> Path:
    """Two good samples and one corrupt clip (a shortfall the loss gate must see)."""
    video = cut_clip(clips["carphone"], 9)
    return make_shards(
        tmp_path_factory.mktemp("publish-flow") / "src",
        {"s": [sample(0, 0, video, b"one"), sample(1, 0, video, b"two"), sample(1, 1, b"no video", b"bad")]},
    )


def _keys(bucket: str) -> dict[str, dict[str, Any]]:
    client = boto3.client("s3")
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.head_object(Bucket=bucket, Key=o["Key"]) for o in listed}


def test_the_build_uploads_after_its_gates_and_not_when_a_gate_stops_it(tmp_path, source, tiny_model, bucket):
    target = f"s3://{bucket}/wan"
    stopped = config(source, tiny_model, tmp_path / "stopped", on_loss="abort", upload={"to": target})
    ok, message = run_build(stopped)
    assert not ok and "LossAborted" in message
    assert _keys(bucket) == {}  # the loss gate stopped the run before the upload step

    ok, result = run_build(config(source, tiny_model, tmp_path / "out", upload={"to": target, "chunk_mb": 5}))
    assert ok, result
    uploaded = result["upload"]
    assert uploaded["counts"]["sent"] == len(_keys(bucket)) and uploaded["counts"]["conflicts"] == 0
    keys = _keys(bucket)
    assert {"wan/cache.json", "wan/README.md", "wan/ledger/s.jsonl"} <= set(keys)
    assert keys["wan/cache.json"]["Metadata"]["latentforge-role"] == "manifest"
    data = [k for k in keys if k.endswith(".pt")]
    assert len(data) == 2 and all(keys[k]["Metadata"]["latentforge-role"] == "data" for k in data)
    report = json.loads(Path(uploaded["upload_report"]).read_text())
    assert report["check"]["ok"] and report["check"]["verified"] == len(keys)
    assert report["gates"] == {"skipped": False, "problems": []}


def test_a_failed_gate_stops_the_upload_unless_skipped_and_recorded(tmp_path, source, tiny_model, bucket):
    out = tmp_path / "out"
    ok, _ = run_build(config(source, tiny_model, out, on_loss="abort"))  # the run report records the shortfall
    assert not ok
    target = f"s3://{bucket}/c"
    refused = runner.invoke(app, ["upload", str(out), "--to", target])
    assert refused.exit_code == 1 and "nobody accepted the loss" in refused.output
    assert _keys(bucket) == {}
    forced = runner.invoke(app, ["upload", str(out), "--to", target, "--skip-gates"])
    assert forced.exit_code == 0, forced.output
    report = json.loads(Path(re.search(r"upload report\s+(\S+\.json)", forced.output)[1]).read_text())
    assert report["gates"]["skipped"] and "nobody accepted the loss" in report["gates"]["problems"][0]
    assert len(_keys(bucket)) == report["check"]["verified"]


def test_a_changed_remote_object_is_replaced_only_with_its_token(tmp_path, source, tiny_model, bucket):
    out = tmp_path / "out"
    ok, _ = run_build(config(source, tiny_model, out))
    assert ok
    target = f"s3://{bucket}/c"
    assert runner.invoke(app, ["upload", str(out), "--to", target]).exit_code == 0
    client = boto3.client("s3")
    sample_key = next(k for k in _keys(bucket) if k.endswith(".pt"))
    client.put_object(Bucket=bucket, Key=sample_key, Body=b"latents of another encoder")  # someone else's
    other_copy = tmp_path / "other"
    shutil.copytree(out, other_copy)

    # --on-conflict abort: the test harness is a reachable API, where the default would be to ask.
    refused = runner.invoke(app, ["upload", str(out), "--to", target, "--on-conflict", "abort"])
    assert refused.exit_code == 1 and sample_key.removeprefix("c/") in refused.output
    token = re.search(r"--approve-replace (\w+)", refused.output)[1]
    assert client.get_object(Bucket=bucket, Key=sample_key)["Body"].read() == b"latents of another encoder"
    verify = runner.invoke(app, ["upload", str(out), "--to", target, "--verify-only"])
    assert verify.exit_code == 1 and f"size differs:\n  path\n  {sample_key.removeprefix('c/')}" in verify.output

    wrong = runner.invoke(app, ["upload", str(out), "--to", target, "--approve-replace", "0" * 20])
    assert wrong.exit_code == 1 and "does not match" in wrong.output
    approved = runner.invoke(app, ["upload", str(out), "--to", target, "--approve-replace", token])
    assert approved.exit_code == 0, approved.output
    assert client.get_object(Bucket=bucket, Key=sample_key)["Body"].read() == (out / sample_key[2:]).read_bytes()
    assert runner.invoke(app, ["upload", str(out), "--to", target, "--verify-only"]).exit_code == 0


def test_on_a_server_a_remote_conflict_pauses_and_a_person_approves_the_replace(
    tmp_path, source, tiny_model, bucket, prefect_server
):
    out = tmp_path / "out"
    assert run_build(config(source, tiny_model, out))[0]
    target = f"s3://{bucket}/c"
    assert runner.invoke(app, ["upload", str(out), "--to", target]).exit_code == 0
    client = boto3.client("s3")
    sample_key = next(k for k in _keys(bucket) if k.endswith(".pt"))
    client.put_object(Bucket=bucket, Key=sample_key, Body=b"latents of another encoder")
    lf = str(Path(sys.executable).with_name("latentforge"))
    server_env = {k: v for k, v in prefect_server.items() if k.startswith("PREFECT_")}
    with receiver() as hook:
        env = {**os.environ, **server_env, "LATENTFORGE_ALERT_WEBHOOK": hook.url}
        upload = subprocess.Popen(
            [lf, "upload", str(out), "--to", target, "--approval-timeout", "120"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            paused = hook.wait_for(lambda body: isinstance(body, dict) and body.get("kind") == "paused", timeout=120)
            assert paused["flow"] == "upload-cache" and paused["step"] == "upload-replace"
            assert client.get_object(Bucket=bucket, Key=sample_key)["Body"].read() == b"latents of another encoder"
            deadline = time.monotonic() + 60
            with temporary_settings({PREFECT_API_URL: server_env["PREFECT_API_URL"]}):  # answered from this process
                while True:  # the preview is saved just after the pause
                    pending = runner.invoke(app, ["pending"]).output
                    if sample_key.removeprefix("c/") in pending:
                        break
                    assert time.monotonic() < deadline, pending
                    time.sleep(0.5)
                args = ["approve", paused["run_id"], "replace", "--by", "data-lead", "--note", "ours is right"]
                answer = runner.invoke(app, args)
            assert answer.exit_code == 0, answer.output
            output, _ = upload.communicate(timeout=120)
        finally:
            if upload.poll() is None:
                upload.kill()
    assert upload.returncode == 0, output
    assert f"{target}: sent 0 new, updated 0, replaced 1, unchanged 7" in output, output
    assert client.get_object(Bucket=bucket, Key=sample_key)["Body"].read() == (out / sample_key[2:]).read_bytes()
    report = json.loads(Path(re.search(r"upload report\s+(\S+\.json)", output)[1]).read_text())
    (decision,) = report["decisions"]
    assert (decision["gate"], decision["choice"], decision["how"], decision["by"]) == (
        "upload-replace",
        "replace",
        "person",
        "data-lead",
    )
    assert report["check"]["ok"]
