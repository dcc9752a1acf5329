"""The Prefect UI of `latentforge server start` on a non-default port, in a real browser (headless Chromium).

A build pauses at the conflict gate; the test answers it through the UI's Resume form as a person would:
a bare Submit is refused (the run stays paused), then `new_dir` with a note and a name. The run finishes,
OUT-v2 is written, OUT is byte-identical, and the answer is in the new cache's run report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.run import run_build
from infra.audit.run_report import latest_run_report
from tests.browser import BrowserStuck, browser_missing, chromium, open_resume_form, submit_answer
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.pauses import wait_pending
from tests.procs import free_port, prefect_home

LF = str(Path(sys.executable).with_name("latentforge"))
NEW_FRAMES = FRAMES + 4
PAUSE_WAIT = 180


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, str]]]:
    """`latentforge server start` (server, pool, worker) on a free port, UI on: (UI URL, API URL, client env)."""
    home, port = prefect_home(tmp_path_factory.mktemp("ui-server")), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    start = [LF, "server", "start", "--port", str(port), "--home", str(home), "--pool", "lf-ui-pool"]
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    try:
        yield ui, api, {**env, "PREFECT_API_URL": api}
    finally:
        subprocess.run([LF, "server", "stop", "--home", str(home), "--timeout", "10"], env=env, timeout=120)


def test_the_ui_calls_the_api_of_the_server_it_belongs_to(ui_server):
    ui, api, _ = ui_server
    assert not api.endswith(":4200/api")
    with urllib.request.urlopen(f"{ui}/ui-settings", timeout=10) as response:
        assert json.load(response)["api_url"] == api


def _paused_run(api: str, build: subprocess.Popen) -> str:
    return wait_pending(api, build=build, wait_s=PAUSE_WAIT).id


def test_a_person_answers_the_conflict_gate_in_the_ui(ui_server, tmp_path, tiny_model, clips):
    if reason := browser_missing():
        pytest.skip(f"the browser test needs headless Chromium: {reason}")
    ui, api, env = ui_server
    src = make_shards(
        tmp_path / "src", {"s": [sample(0, i, cut_clip(clips["carphone"], 9), b"a call") for i in (0, 1)]}
    )
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out))
    assert ok, result
    before = tree_hashes(out)
    args = [LF, "build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(out), "--device", "cpu"]
    args += ["--dtype", "fp32", "--frames", str(NEW_FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    args += ["--decode-samples", "0"]
    build = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = _paused_run(api, build)
        for attempt in (1, 2):  # a stuck browser is killed by its watchdog; the run is still paused for a second one
            try:
                with chromium() as driver:
                    preview = open_resume_form(driver, ui, run_id, screenshot=tmp_path / "resume-form.png")
                    assert "incompatible" in preview and "frames" in preview and "new_dir" in preview
                    submit_answer(driver, None)  # a bare Submit: refused by the form, the run stays paused
                    assert _paused_run(api, build) == run_id
                    submit_answer(driver, "new_dir", note="keep last week's cache", by="browser-test")
                break
            except BrowserStuck:
                if attempt == 2 or _paused_run(api, build) != run_id:
                    raise
        stdout, stderr = build.communicate(timeout=300)
    finally:
        if build.poll() is None:
            build.kill()
    assert build.returncode == 0, stdout + stderr
    assert tree_hashes(out) == before
    moved = tmp_path / "out-v2"
    assert json.loads((moved / "cache.json").read_text())["spec"]["frames"] == NEW_FRAMES
    (decision,) = latest_run_report(moved).decisions
    assert (decision.gate, decision.choice, decision.how) == ("conflict", "new_dir", "person")
    assert (decision.by, decision.note) == ("browser-test", "keep last week's cache")
