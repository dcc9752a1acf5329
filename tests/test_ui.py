"""The Prefect UI of `latentforge server start` on a non-default port, in a real browser (headless Chromium).

One server and one build serve every test here, in both of Prefect 3.9's UIs (classic at ``/``, the new one at
``/v2``). The build pauses at the conflict gate; a test answers it through the classic UI's Resume form as a
person would: a bare Submit is refused (the run stays paused), then `new_dir` with a note and a name. The run goes
on and pauses at the loss gate (one source sample is not a video, `--on-loss ask`); the next test answers that in
the new UI's Resume dialog the same way (a bare Resume refused, then `accept_loss`). The run finishes, OUT-v2 is
written, OUT is byte-identical, and both answers are in the new cache's run report. Then the finished run's
Artifacts tab is opened in each UI and its decode report followed: every strip picture has loaded and nothing is
cut at the right of a 1600-px window. Screenshots go to ``$LF_UI_SCREENSHOTS`` (default: each test's tmp_path).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.flow_runs import resume_flow_run
from prefect.input import read_flow_run_input
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.approval import ConflictAnswer, LossAnswer, ReplaceAnswer, StaleAnswer
from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from infra.cache import ledger
from tests.browser import (
    BrowserStuck,
    artifact_pictures,
    browser_missing,
    chromium,
    open_resume_form,
    open_resume_form_v2,
    open_run_artifact,
    submit_answer,
    submit_answer_v2,
)
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.pauses import wait_pending
from tests.procs import free_port, prefect_home

LF = str(Path(sys.executable).with_name("latentforge"))
NEW_FRAMES = FRAMES + 4
PAUSE_WAIT = 180
DECODED = 2  # samples the run decodes: strips in its report


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


#: A gate's pause is told apart by its preview: the conflict's lists its choices, the loss's is the reconciliation.
GATE_MARK = {"conflict": "new_dir", "loss": "SHORTFALL"}
API_ANSWER = {"conflict": "new_dir", "loss": "accept_loss"}


def _pending(api: str, build: subprocess.Popen, gate: str) -> str:
    """The id of the run once it is paused at `gate`."""
    return wait_pending(api, build=build, match=lambda r: GATE_MARK[gate] in r.preview, wait_s=PAUSE_WAIT).id


@dataclass
class PausedBuild:
    """The module's one build: it pauses at the conflict gate, then at the loss gate, until the tests (or
    `answer_by_api`) answer them; then it decodes its samples and ends."""

    run_id: str
    process: subprocess.Popen
    out: Path
    before: dict[str, str]
    api: str
    lost_reason: str  # the ledger's reason for the sample that is not a video
    output: str | None = None

    def finish(self) -> str:
        """Wait for the build to end (answered); its stdout and stderr."""
        if self.output is None:
            stdout, stderr = self.process.communicate(timeout=300)
            self.output = stdout + stderr
        return self.output

    def answer_by_api(self, until: str | None = None) -> None:
        """Answer each pause through the API (a test of the UI before did not run) until the run pauses at
        `until` (None: until the run ends)."""
        while self.process.poll() is None:
            try:
                run = wait_pending(self.api, wait_s=5)
            except AssertionError:
                continue  # not paused now: working, or ended
            gate = next(g for g, mark in GATE_MARK.items() if mark in run.preview)
            if gate == until:
                return
            # Exception suppressed: answered a moment ago and still listed as paused
            with contextlib.suppress(Exception), temporary_settings({PREFECT_API_URL: self.api}):
                resume_flow_run(run.id, run_input={"choice": API_ANSWER[gate], "by": "test_ui api"})


@pytest.fixture(scope="module")
def paused(ui_server, tmp_path_factory, tiny_model, clips) -> Iterator[PausedBuild]:
    """A cache of two samples (and a third that is not a video: a loss, accepted), then a `build` of other frames
    on the server with `--on-loss ask`: paused at the conflict gate."""
    _, api, env = ui_server
    root = tmp_path_factory.mktemp("ui-run")
    samples = [sample(0, i, cut_clip(clips["carphone"], 9), b"a call") for i in (0, 1)]
    src = make_shards(root / "src", {"s": [*samples, sample(0, 2, b"not a video at all", b"broken")]})
    out = root / "out"
    ok, result = run_build(config(src, tiny_model, out, on_loss="accept"))
    assert ok, result
    before = tree_hashes(out)
    args = [LF, "build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(out), "--device", "cpu"]
    args += ["--dtype", "fp32", "--frames", str(NEW_FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    args += ["--decode-samples", str(DECODED), "--on-loss", "ask"]
    build = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (reason,) = {r.reason for rows in ledger.read_all(out).values() for r in rows.values() if r.status != "done"}
        yield PausedBuild(_pending(api, build, "conflict"), build, out, before, api, str(reason))
    finally:
        if build.poll() is None:
            build.kill()
            build.communicate()


@pytest.fixture(scope="module")
def finished(paused: PausedBuild) -> PausedBuild:
    """The build, answered and ended: by the UI tests when they ran first, else through the API."""
    paused.answer_by_api()
    output = paused.finish()
    assert paused.process.returncode == 0, output
    return paused


def _screens(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("LF_UI_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _with_browser(attempt_answer, still_paused) -> None:
    """Run `attempt_answer(driver)` in a fresh browser; a stuck browser is killed by its watchdog, a page that did
    not come within WAIT_S (a loaded CI machine) is given up, and while the run is still paused at the same gate one
    more browser tries. A second failure is the test's failure."""
    from selenium.common.exceptions import TimeoutException  # noqa: PLC0415 - optional: only with a browser

    for attempt in (1, 2):
        try:
            with chromium() as driver:
                attempt_answer(driver)
            return
        except (BrowserStuck, TimeoutException):
            if attempt == 2 or not still_paused():
                raise


def test_a_person_answers_the_conflict_gate_in_the_classic_ui(ui_server, paused, tmp_path):
    if reason := browser_missing():
        pytest.skip(f"the browser test needs headless Chromium: {reason}")
    ui, api, _ = ui_server
    run_id, build = paused.run_id, paused.process

    def answer(driver) -> None:
        preview = open_resume_form(driver, ui, run_id, screenshot=_screens(tmp_path) / "v1-resume-form.png")
        assert "incompatible" in preview and "frames" in preview and "new_dir" in preview
        submit_answer(driver, None)  # a bare Submit: refused by the form, the run stays paused
        assert _pending(api, build, "conflict") == run_id
        submit_answer(driver, "new_dir", note="keep last week's cache", by="browser-test")

    _with_browser(answer, lambda: _pending(api, build, "conflict") == run_id)
    assert _pending(api, build, "loss") == run_id  # answered: the run went on, to the next gate


def test_a_person_answers_the_loss_gate_in_the_new_ui(ui_server, paused, tmp_path):
    if reason := browser_missing():
        pytest.skip(f"the browser test needs headless Chromium: {reason}")
    ui, api, _ = ui_server
    run_id, build = paused.run_id, paused.process
    paused.answer_by_api(until="loss")  # the conflict gate: answered by the classic UI's test, or here
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
        stored = read_flow_run_input(state.state_details.run_input_keyset["schema"], run_id)  # the form
    assert stored["properties"]["choice"]["title"] == "Decision" and "LossChoice" not in json.dumps(stored)

    def answer(driver) -> None:
        preview = open_resume_form_v2(driver, ui, run_id, screenshot=_screens(tmp_path) / "v2-resume-form.png")
        assert "SHORTFALL 1" in preview and paused.lost_reason in preview
        assert "Decision" in preview and "LossChoice" not in preview  # the field's label is for a person
        submit_answer_v2(driver, None)  # a bare Resume: refused, the run stays paused
        assert _pending(api, build, "loss") == run_id
        submit_answer_v2(driver, "accept_loss", note="the broken clip is known", by="browser-test-v2")

    _with_browser(answer, lambda: _pending(api, build, "loss") == run_id)
    output = paused.finish()
    assert build.returncode == 0, output
    assert tree_hashes(paused.out) == paused.before
    moved = paused.out.with_name("out-v2")
    assert json.loads((moved / "cache.json").read_text())["spec"]["frames"] == NEW_FRAMES
    decisions = {d.gate: d for d in latest_run_report(moved).decisions}
    loss = decisions["loss"]
    assert (loss.choice, loss.how, loss.by, loss.note) == (
        "accept_loss",
        "person",
        "browser-test-v2",
        "the broken clip is known",
    )
    conflict = decisions["conflict"]
    assert (conflict.choice, conflict.how) == ("new_dir", "person")
    if conflict.by != "test_ui api":  # answered in the classic UI by the test before
        assert (conflict.by, conflict.note) == ("browser-test", "keep last week's cache")


def _artifact_id(api: str, run_id: str, key: str) -> str:
    body = json.dumps({"artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [run_id]}}}).encode()
    request = urllib.request.Request(f"{api}/artifacts/filter", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        (artifact,) = json.load(response)
    assert len(artifact["data"]) < 1_000_000  # under the server's event size limit, with a margin
    return artifact["id"]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_decode_strips_show_as_pictures_in_both_uis(ui_server, finished, tmp_path, version):
    if reason := browser_missing():
        pytest.skip(f"the browser test needs headless Chromium: {reason}")
    ui, api, _ = ui_server
    artifact = _artifact_id(api, finished.run_id, "decode-verify-report")
    base, shots = (ui if version == "v1" else f"{ui}/v2"), _screens(tmp_path)
    with chromium(width=1600) as driver:
        url = open_run_artifact(driver, base, finished.run_id, "decode-verify-report", shots / f"run-{version}.png")
        assert url.endswith(f"/artifacts/artifact/{artifact}") and (version == "v1") != ("/v2/" in url)
        pictures = artifact_pictures(driver, None, DECODED, shots / f"decode-{version}.png")
    assert len(pictures["images"]) == DECODED, pictures
    assert all(image["natural"] > 0 and image["shown"] > 0 for image in pictures["images"]), pictures
    assert pictures["overflow"] == [], pictures  # no table or text runs past the window's right edge
    assert "PSNR" in pictures["text"] and "SSIM" in pictures["text"]


@pytest.mark.parametrize("model", [ConflictAnswer, StaleAnswer, LossAnswer, ReplaceAnswer])
def test_every_gate_pauses_with_the_form_the_browser_tests_answer(model):
    """The UIs draw the form from the answer model's JSON schema: every gate's is the one tried above in both UIs
    (a required enum `choice`, optional text `note` and `by`), so the stale and upload-replace gates' forms work
    the same way."""
    schema = model.model_json_schema()
    assert schema["required"] == ["choice"] and set(schema["properties"]) == {"choice", "note", "by"}
    titles = {f: schema["properties"][f]["title"] for f in ("note", "by")}
    assert titles == {"note": "Note", "by": "Decided by"}
    assert all(schema["properties"][f]["type"] == "string" and schema["properties"][f]["default"] == "" for f in titles)
    choice = schema["properties"]["choice"]
    # labelled for a person, inline (a $ref made the V2 form label it with the enum's class name, `LossChoice`)
    assert choice["title"] == "Decision" and choice["type"] == "string" and "abort" in choice["enum"]
    assert all(f"{value}:" in choice["description"] for value in choice["enum"])  # what each choice does
    assert "$defs" not in schema and "Choice" not in json.dumps(schema)
