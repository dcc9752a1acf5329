"""Runs named as the README prints them: `rerun` and `approve` take a unique prefix of a run id; `rerun
--failed-only` takes the gate flags and keeps a loss its run accepted accepted; `pending` does not list a run
whose process was killed while it was paused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from prefect.settings import PREFECT_API_URL
from typer.testing import CliRunner

from flows.cli import app
from flows.paused_runs import approve as resume
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.formats import get_format
from infra.sources import open_source
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.pauses import wait_pending

runner = CliRunner()
LF = str(Path(sys.executable).with_name("latentforge"))


def _latents_path(src: Path, shard: str, key: str) -> str:
    source = open_source(f"vbvr:{src}")
    ref = next(r for r in source.samples(next(s for s in source.shards() if s.id == shard)) if r.key == key)
    return get_format("pt").paths(ref.stem, ["latents"])["latents"]


def test_rerun_keeps_an_accepted_loss_accepted_and_takes_the_gate_flags(tmp_path, tiny_model, clips):
    """Issue 33 item 6: a run whose loss (one corrupt clip) a person accepted, with one sample failed (a stray
    file in its place): `rerun` by a short id re-encodes that sample and ends done, saying the loss stays accepted;
    `--on-loss` given wins."""
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(
        tmp_path / "src",
        {"a": [sample(0, i, video, f"clip {i}".encode()) for i in range(2)], "b": [sample(1, 0, b"not a video", b"x")]},
    )
    out = tmp_path / "out"
    assert run_build(config(src, tiny_model, out, max_samples_per_shard=1))[0]  # a cache, one sample of each shard
    key = sorted(ledger_key for ledger_key in (r.key for r in open_source(f"vbvr:{src}").samples(
        next(s for s in open_source(f"vbvr:{src}").shards() if s.id == "a"))))[1]  # fmt: skip
    stray = out / _latents_path(src, "a", key)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"somebody else's file")

    answered: list[str] = []

    def answer() -> None:  # the person at the loss gate, through this process's API
        run = wait_pending(match=lambda r: "missing" in r.preview.lower() or "shortfall" in r.preview.lower())
        answered.append(resume(run.id, "accept_loss", "the corrupt clip is known", "tester"))

    person = threading.Thread(target=answer, daemon=True)
    person.start()
    # the stray is a file a trainer would load that no row owns: kept by reuse, its sample output_exists
    ok, first = run_build(config(src, tiny_model, out, on_loss="ask", approval_timeout=20, on_conflict="reuse"))
    person.join(timeout=10)
    assert ok and answered, first
    run_id = json.loads(Path(first["run_report"]).read_text())["flow_run_id"]
    assert ledger.read_all(out)["a"][key].reason == "output_exists"
    counted = runner.invoke(app, ["reconcile", str(out)])  # the failed sample's detail says what is in its place
    assert "not a sample file: it does not load" in counted.stdout and "unreadable (" not in counted.stdout
    stray.unlink()

    given = runner.invoke(app, ["rerun", run_id[:8], "--failed-only", "--on-loss", "abort", "--dry-run"])
    assert given.exit_code == 0, given.output
    assert "--on-loss abort" in given.stdout and "stays accepted" not in given.stdout

    result = runner.invoke(app, ["rerun", run_id[:8], "--failed-only"])
    assert result.exit_code == 0, result.output
    assert f"the loss accepted in {run_id} stays accepted" in result.stdout
    assert "accept_loss by tester" in result.stdout and "video_decode_error" in result.stdout
    assert "rerun done: 1 encoded, 0 still failed" in result.stdout
    assert ledger.read_all(out)["a"][key].status == "done"


def test_short_ids_resolve_and_unknown_ones_are_named():
    unknown = runner.invoke(app, ["rerun", "fffff0fffff", "--failed-only"])
    assert unknown.exit_code == 2 and "no flow run id starts with 'fffff0fffff'" in unknown.stderr, unknown.output
    bad = runner.invoke(app, ["approve", "not-hex", "abort"])
    assert bad.exit_code == 2 and "is not a flow run id" in bad.stderr, bad.output


def test_a_run_killed_while_paused_is_not_listed_as_paused(tmp_path, tiny_model, clips):
    """Issue 33 item 7: a build paused at the loss gate (from another process, on this session's API) answers to its
    short id; SIGKILLed, `pending` no longer lists it as paused and says its process is gone."""
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, video, b"fine"), sample(0, 1, b"not a video", b"x")]})
    url = PREFECT_API_URL.value()
    env = {**os.environ, "PREFECT_API_URL": url}
    args = [LF, "build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(tmp_path / "out")]
    args += ["--device", "cpu", "--dtype", "fp32", "--frames", str(FRAMES), "--height", str(HEIGHT)]
    args += ["--width", str(WIDTH), "--decode-samples", "0", "--on-loss", "ask"]
    build = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        run = wait_pending(url, build=build)
        listed = runner.invoke(app, ["pending"])
        assert listed.exit_code == 0 and run.id in listed.stdout and "no paused runs" not in listed.stdout
        refused = runner.invoke(app, ["approve", run.id[:8], "no_such_choice"])
        assert refused.exit_code == 2 and "not resumed" in refused.stderr and "badly formed" not in refused.output
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        _, stderr = build.communicate(timeout=30)
    assert "sanity" in stderr.decode() and "clip_output" not in stderr.decode()  # the model loaded, quietly
    after = runner.invoke(app, ["pending"])
    assert after.exit_code == 0, after.output
    assert "no paused runs" in after.stdout
    assert f"not waiting: {run.id}" in after.stdout and "is gone" in after.stdout
