"""Hard-stop approvals on a real Prefect server: a build pauses, `latentforge approve` answers from another process
(the build a subprocess, the answer from the test's); the other choices are answered through the session's API from
a thread while the build runs in the test's process (the same pause, input and resume).

For every conflict path the existing cache's files are hashed before and after: identical, except under
an approved overwrite (and then only the re-encoded samples changed).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from typer.testing import CliRunner, Result

from flows.cli import app
from flows.paused_runs import approve as resume
from flows.paused_runs import pending_runs
from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from infra.gates.conflicts import overwrite_token
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.pauses import wait_pending

NEW_FRAMES = FRAMES + 4
LF = str(Path(sys.executable).with_name("latentforge"))
PAUSE_WAIT = 120


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model, clips) -> tuple[Path, Path]:
    """A source and a finished cache (2 samples at FRAMES) to conflict with."""
    root = tmp_path_factory.mktemp("approvals")
    videos = [cut_clip(clips["carphone"], 9), cut_clip(clips["bikes"], 9, width=160)]
    src = make_shards(root / "src", {"s": [sample(0, i, v, f"clip {i}".encode()) for i, v in enumerate(videos)]})
    ok, result = run_build(config(src, tiny_model, root / "cache"))
    assert ok and result["done"] == 2, result
    return src, root / "cache"


def _copy(cache: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(cache, out)
    return out


def _build(src: Path, model: Path, out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    args = [LF, "build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--device", "cpu"]
    args += ["--dtype", "fp32", "--frames", str(NEW_FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _paused_run(env: dict[str, str], build: subprocess.Popen) -> str:
    run = wait_pending(env["PREFECT_API_URL"], build=build, wait_s=PAUSE_WAIT)
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        assert len(pending_runs()) == 1
    assert "incompatible" in run.preview.lower() and "frames" in run.preview
    return run.id


def _approve(env: dict[str, str], run_id: str, choice: str) -> Result:
    """`latentforge approve` from this process (the build is another one), through the server."""
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        return CliRunner().invoke(app, ["approve", run_id, choice, "--note", "test"])


def _finish(build: subprocess.Popen) -> tuple[int, str]:
    stdout, stderr = build.communicate(timeout=300)
    return build.returncode, stdout + stderr


def test_a_bad_choice_is_refused_and_the_run_stays_paused(built, tiny_model, prefect_server, tmp_path):
    src, cache = built
    out = _copy(cache, tmp_path)
    before = tree_hashes(out)
    build = _build(src, tiny_model, out, prefect_server, "--on-conflict", "ask")
    run_id = _paused_run(prefect_server, build)
    refused = _approve(prefect_server, run_id, "delete_everything")
    assert refused.exit_code == 2 and "not resumed" in refused.output
    assert _paused_run(prefect_server, build) == run_id  # still paused, still waiting
    assert _approve(prefect_server, run_id, "new_dir").exit_code == 0
    code, output = _finish(build)
    assert code == 0, output
    assert tree_hashes(out) == before
    moved = json.loads((tmp_path / "out-v2" / "cache.json").read_text())
    assert moved["spec"]["frames"] == NEW_FRAMES
    (decision,) = latest_run_report(tmp_path / "out-v2").decisions  # who decided, in the new cache's run report
    assert (decision.gate, decision.choice, decision.how, decision.note) == ("conflict", "new_dir", "person", "test")
    assert decision.details["state"] == "incompatible" and decision.details["out"] == str(out)


def _answered_in_process(
    src: Path, model: Path, out: Path, choice: str, meanwhile: Callable[[], None] = lambda: None
) -> tuple[bool, Any]:
    """The build in this process on the session's API, paused at the conflict gate and answered `choice` from a
    thread through that API (the cross-process answer has its own test above); `meanwhile` runs once it is paused,
    before the answer."""
    answered: list[str] = []

    def answer() -> None:
        run = wait_pending(match=lambda run: str(out) in run.preview, wait_s=PAUSE_WAIT)
        meanwhile()
        resume(run.id, choice, "test", "test")
        answered.append(run.id)

    thread = threading.Thread(target=answer, name="approver", daemon=True)
    thread.start()
    try:
        return run_build(config(src, model, out, frames=NEW_FRAMES, on_conflict="ask", approval_timeout=PAUSE_WAIT))
    finally:
        thread.join(timeout=5)
        assert answered, "the paused run was never answered"


def test_reuse_adopts_the_existing_spec_and_resumes(built, tiny_model, tmp_path):
    src, cache = built
    out = _copy(cache, tmp_path)
    before = tree_hashes(out)
    ok, result = _answered_in_process(src, tiny_model, out, "reuse")
    assert ok and result["reused"] == 2 and result["done"] == 2, result
    assert tree_hashes(out) == before


def test_approved_overwrite_replaces_samples_and_keeps_the_old_cache_json(built, tiny_model, tmp_path):
    src, cache = built
    out = _copy(cache, tmp_path)
    before = tree_hashes(out)
    old = json.loads((out / "cache.json").read_text())
    ok, result = _answered_in_process(src, tiny_model, out, "overwrite")
    assert ok, result
    after = tree_hashes(out)
    samples = [k for k in before if k.endswith(".pt")]
    assert len(samples) == 2 and all(after[k] != before[k] for k in samples)
    assert after[f"cache.{old['fingerprint'][:16]}.json"] == before["cache.json"]
    assert json.loads((out / "cache.json").read_text())["spec"]["frames"] == NEW_FRAMES


def test_an_overwrite_answered_after_out_changed_while_paused_replaces_nothing(built, tiny_model, tmp_path):
    """The person approved what the preview showed; a file added to OUT while the run waited voids that approval:
    the run stops with one line, and nothing is replaced (issue 53: approvals bound to what the person saw)."""
    src, cache = built
    out = _copy(cache, tmp_path)
    before: dict[str, str] = {}

    def add_a_file() -> None:
        (out / "added-while-paused.pt").write_bytes(b"not in the preview")
        before.update(tree_hashes(out))

    ok, message = _answered_in_process(src, tiny_model, out, "overwrite", add_a_file)
    assert not ok and "changed while the question was open" in str(message) and "nothing was replaced" in str(message)
    assert before and tree_hashes(out) == before


def test_a_timeout_is_abort_with_nothing_written(built, tiny_model, tmp_path, caplog):
    """In this process, on the session's API (nobody answers, so no second process is needed)."""
    src, cache = built
    out = _copy(cache, tmp_path)
    before = tree_hashes(out)
    with caplog.at_level(logging.INFO, logger="prefect.flow_runs"):
        ok, message = run_build(config(src, tiny_model, out, frames=NEW_FRAMES, on_conflict="ask", approval_timeout=3))
    assert not ok, message
    assert "no answer within 3 s: treated as abort" in caplog.text, caplog.text[-2000:]
    assert tree_hashes(out) == before


def test_overwrite_token_is_bound_to_path_and_change(built, tiny_model, tmp_path):
    src, cache = built
    out, elsewhere = _copy(cache, tmp_path), tmp_path / "elsewhere"
    shutil.copytree(cache, elsewhere)
    before = tree_hashes(out)
    verify = CliRunner().invoke(app, ["verify", str(out), "--frames", str(NEW_FRAMES)])
    assert verify.exit_code == 1 and "INCOMPATIBLE" in verify.output
    token = verify.output.split("--approve-overwrite ")[1].split()[0]
    old_fp = json.loads((out / "cache.json").read_text())["fingerprint"]
    assert token != overwrite_token(elsewhere, old_fp, "anything")

    ok, message = run_build(config(src, tiny_model, elsewhere, frames=NEW_FRAMES, approve_overwrite=token))
    assert not ok and "does not match" in message
    ok, message = run_build(config(src, tiny_model, out, frames=NEW_FRAMES + 4, approve_overwrite=token))
    assert not ok and "does not match" in message
    assert tree_hashes(out) == before
    ok, result = run_build(config(src, tiny_model, out, frames=NEW_FRAMES, approve_overwrite=token))
    assert ok and result["done"] == 2, result
    assert json.loads((out / "cache.json").read_text())["spec"]["frames"] == NEW_FRAMES


def test_unattended_policies_new_dir_and_reuse(built, tiny_model, tmp_path):
    src, cache = built
    out = _copy(cache, tmp_path)
    before = tree_hashes(out)
    (tmp_path / "out-v2").mkdir()  # never a directory that exists
    ok, result = run_build(config(src, tiny_model, out, frames=NEW_FRAMES, on_conflict="new_dir"))
    assert ok and result["out"] == str(tmp_path / "out-v3")
    (decision,) = latest_run_report(tmp_path / "out-v3").decisions
    assert (decision.gate, decision.choice, decision.how, decision.by) == (
        "conflict",
        "new_dir",
        "policy",
        "on_conflict=new_dir",
    )
    ok, result = run_build(config(src, tiny_model, out, frames=NEW_FRAMES, on_conflict="reuse"))
    assert ok and result["reused"] == 2 and result["encoded"] == 0
    assert tree_hashes(out) == before
