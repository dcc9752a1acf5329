"""Recovery as printed: every exit 75 and every gate that stops a build names what to run next, and what it names is
run here as printed (`latentforge build` in this process, on the session's Prefect API) and finishes the cache.

The command is the test's; the flags added or left out are parsed from the run's own ``error:`` line, never written
here by hand. Each gate's error is one ``error:`` line first (what, and the flag that answers it), its detail after.
An interrupted approved overwrite (Ctrl-C after a few rows) is "this change, in progress": the same command resumes
it, and `inspect` and `verify` count the cache's samples per fingerprint as the ledger does, with what is pending.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.cachedir import overwrite_in_progress
from infra.errors import EXIT_PREEMPTED
from infra.faults import HOLD_ENV, LOG_ENV
from infra.ops import preempt
from tests.conftest import HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip

OLD_FRAMES, NEW_FRAMES = 9, 5  # both ≡ 1 mod 4: the cache's spec and the one a later command asks for
SAMPLES = 4
WAIT_S = 120


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips["carphone"], 9), cut_clip(clips["bikes"], 9, width=160)]
    samples = [sample(i % 2, i, videos[i % 2], f"clip {i}: something moves".encode()) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("recovery-src"), {"s": samples})


@pytest.fixture(scope="module")
def cache(source, tiny_model, tmp_path_factory) -> Path:
    """A finished cache at OLD_FRAMES: what later commands conflict with (copied per test)."""
    out = tmp_path_factory.mktemp("recovery") / "cache"
    ok, result = run_build(config(source, tiny_model, out, frames=OLD_FRAMES, workers=1))
    assert ok and result["done"] == SAMPLES, result
    return out


def _copy(cache: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(cache, out)
    return out


def _build(source: Path, model: Path, out: Path, *extra: str) -> list[str]:
    """A user's `latentforge build` (its arguments): the gates' policies given, so that no gate waits for a person."""
    return [
        "build", "--source", f"vbvr:{source}", "--model", str(model), "--out", str(out),
        "--frames", str(NEW_FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu",
        "--dtype", "fp32", "--workers", "1", "--decode-samples", "0", "--on-loss", "accept", *extra,
    ]  # fmt: skip


def _run(args: list[str]) -> Result:
    return CliRunner().invoke(app, args)


def _error(result: Result) -> str:
    """The run's one ``error:`` line (there must be exactly one)."""
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output[-3000:]
    return lines[0]


def _interrupted(args: list[str], after: int, tmp: Path) -> Result:
    """The build, held after its `after`-th journalled sample and sent SIGINT there (Ctrl-C), as a terminal does."""
    hold, log = tmp / "hold", tmp / "points.log"
    hold.touch()
    log.write_text("")
    finished = threading.Event()

    def interrupt() -> None:
        deadline = time.monotonic() + WAIT_S
        while log.read_text().count("sample\n") < after and not finished.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not finished.is_set():
            os.kill(os.getpid(), signal.SIGINT)
            while not preempt.requested() and time.monotonic() < deadline:
                time.sleep(0.01)
        hold.unlink()

    thread = threading.Thread(target=interrupt, daemon=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HOLD_ENV, f"sample:{after}={hold}")
        mp.setenv(LOG_ENV, str(log))
        thread.start()
        try:
            return _run(args)
        finally:
            finished.set()
            thread.join(timeout=30)


def _files(out: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _per_fingerprint(out: Path) -> dict[str, int]:
    rows = [row for rows in ledger.read_all(out).values() for row in rows.values() if row.status == "done"]
    return dict(Counter(row.fingerprint for row in rows))


def test_an_interrupted_overwrite_is_resumed_by_the_same_command_and_inspect_and_verify_agree_with_the_ledger(
    cache, source, tiny_model, tmp_path
):
    out = _copy(cache, tmp_path)
    old = json.loads((out / "cache.json").read_text())["fingerprint"]
    verify = _run(["verify", str(out), "--frames", str(NEW_FRAMES)])
    token = re.search(r"--approve-overwrite (\S+)", verify.output).group(1)
    args = _build(source, tiny_model, out, "--approve-overwrite", token)

    stopped = _interrupted(args, 2, tmp_path)
    assert stopped.exit_code == EXIT_PREEMPTED, stopped.output[-3000:]
    assert "to resume, run the same command again" in _error(stopped)
    new = json.loads((out / "cache.json").read_text())["fingerprint"]
    counts = _per_fingerprint(out)
    assert counts == {new: 2, old: SAMPLES - 2}, counts  # half overwritten

    inspected = json.loads(_run(["inspect", str(out), "--json"]).output)
    assert inspected["fingerprints"] == counts
    assert (inspected["done"], inspected["overwrite"]) == (2, {"from": old, "pending": SAMPLES - 2})
    assert [g["frames"] for g in inspected["geometry"]] == [NEW_FRAMES]  # this spec's samples, not the old ones
    assert all(s["fingerprint"] == new for s in inspected["samples"].values())  # a sample of this spec, not the old
    text = _run(["inspect", str(out)]).output
    assert f"{SAMPLES - 2} of {old[:16]}" in text and "the same build command resumes it" in text, text
    checked = _run(["verify", str(out), "--json"])
    assert checked.exit_code == 0, checked.output[-3000:]  # a build may write there: it resumes the overwrite
    report = json.loads(checked.output)
    assert (report["kind"], report["done"], report["problems"]) == ("compatible", 2, [])
    assert report["fingerprints"] == counts and report["overwrite"] == {"from": old, "pending": SAMPLES - 2}
    assert report["overwrite_token"] is None

    again = _run(args)  # as printed: the same command
    assert again.exit_code == 0, again.output[-3000:]
    assert re.search(rf"samples\s+{SAMPLES}: {SAMPLES} done \({SAMPLES - 2} encoded now, 2 reused\)", again.output)
    assert _per_fingerprint(out) == {new: SAMPLES}
    assert json.loads((out / f"cache.{old[:16]}.json").read_text())["fingerprint"] == old  # the old spec kept
    finished = json.loads(_run(["inspect", str(out), "--json"]).output)
    assert (finished["done"], finished["overwrite"]) == (SAMPLES, None)


def _with(args: list[str], flag: str, value: str | None = None) -> list[str]:
    """`args` with `flag` (and its value) set as a user adds it: a value given before is replaced."""
    args = _without(args, flag)
    return [*args, flag, *([value] if value is not None else [])]


def _without(args: list[str], flag: str) -> list[str]:
    """`args` with `flag` and its value left out."""
    if flag not in args:
        return list(args)
    at = args.index(flag)
    return args[:at] + args[at + 2 :]


def _last_flow_run_message() -> str:
    from prefect.client.orchestration import get_client  # noqa: PLC0415 - test helper: the session's API
    from prefect.client.schemas.sorting import FlowRunSort  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
    return run.state.message or ""


def test_a_conflict_stops_with_one_short_error_line_and_each_answer_it_prints_runs_as_printed(
    cache, source, tiny_model, tmp_path
):
    out = _copy(cache, tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*.pt")}
    args = _build(source, tiny_model, out, "--on-conflict", "abort")
    stopped = _run(args)
    assert stopped.exit_code == 1, stopped.output[-3000:]
    error = _error(stopped)
    assert stopped.output.startswith("error: ") and error.startswith(f"error: ConflictAborted: {out} holds another")
    assert f"frames {OLD_FRAMES} → {NEW_FRAMES}" in error and f"{SAMPLES} sample(s) done" in error
    detail = stopped.output.splitlines()[1:]
    assert 0 < len(detail) <= 6 and "identity_scheme" not in stopped.output, stopped.output  # the diff, not the spec
    assert "abort by the setting on_conflict=abort" in stopped.output and "(default)" not in stopped.output
    state = _last_flow_run_message()  # the Prefect Failed state: the same line, short
    assert "\n" not in state and "holds another cache" in state and len(state) < 600, state

    token = re.search(r"add to the same command --approve-overwrite (\w+) to replace it", error).group(1)
    assert re.search(r"--on-conflict new_dir to write \S+out-v2 instead", error)
    leave_out = re.search(r"--on-conflict reuse without (--[\w-]+) to resume it", error).group(1)
    assert leave_out == "--frames"

    reused = _run(_with(_without(args, leave_out), "--on-conflict", "reuse"))
    assert reused.exit_code == 0, reused.output[-3000:]
    assert re.search(rf"{SAMPLES} done \(0 encoded now, {SAMPLES} reused\)", reused.output), reused.output
    assert {p: p.read_bytes() for p in out.rglob("*.pt")} == before
    moved = _run(_with(args, "--on-conflict", "new_dir"))
    assert moved.exit_code == 0, moved.output[-3000:]
    assert _per_fingerprint(tmp_path / "out-v2") and (tmp_path / "out-v2" / "cache.json").exists()
    assert {p: p.read_bytes() for p in out.rglob("*.pt")} == before
    replaced = _run([*args, "--approve-overwrite", token])
    assert replaced.exit_code == 0, replaced.output[-3000:]
    new = json.loads((out / "cache.json").read_text())["fingerprint"]
    assert _per_fingerprint(out) == {new: SAMPLES}


def test_reuse_with_a_setting_that_asks_for_another_value_is_refused_up_front_naming_it(
    cache, source, tiny_model, tmp_path
):
    out = _copy(cache, tmp_path)
    before = _files(out)
    args = _build(source, tiny_model, out, "--on-conflict", "reuse")  # and --frames NEW_FRAMES: the cache has OLD
    refused = _run(args)
    assert refused.exit_code == 2, refused.output[-3000:]
    error = _error(refused)
    assert f"--frames {NEW_FRAMES} asks for another" in error and f"frames {OLD_FRAMES}" in error, error
    assert _files(out) == before  # refused before anything ran
    leave_out = re.search(r"to reuse it, leave out (--[\w-]+);", error).group(1)
    token = re.search(r"use --approve-overwrite (\w+) \(replace", error).group(1)
    reused = _run(_without(args, leave_out))
    assert reused.exit_code == 0 and f"{SAMPLES} done (0 encoded now, {SAMPLES} reused)" in reused.output
    replaced = _run(_with(_without(args, "--on-conflict"), "--approve-overwrite", token))
    assert replaced.exit_code == 0, replaced.output[-3000:]
    assert len(_per_fingerprint(out)) == 1
    assert json.loads((out / "cache.json").read_text())["spec"]["frames"] == NEW_FRAMES


def test_the_loss_and_stale_gates_answers_run_as_printed(clips, tiny_model, tmp_path):
    video = cut_clip(clips["carphone"], 9)

    def samples(prompt: bytes) -> list:
        return [sample(0, 0, video, prompt), sample(0, 1, video, b"clip 1"), sample(1, 2, clips["audio_only"], b"x")]

    src = make_shards(tmp_path / "src", {"s": samples(b"clip 0")})
    out = tmp_path / "out"
    args = _with(_with(_build(src, tiny_model, out), "--on-loss", "abort"), "--on-stale", "abort")
    lost = _run(args)  # one sample has no video stream: a shortfall, and nobody accepted it
    assert lost.exit_code == 1, lost.output[-3000:]
    error = _error(lost)
    assert error.startswith(f"error: LossAborted: 1 sample(s) missing from {out}"), error
    assert "decided: abort by the setting on_loss=abort" in lost.output and "(default)" not in lost.output
    flag, value = re.search(r"add (--on-loss) (\w+) to the same command", error).groups()
    args = _with(args, flag, value)
    accepted = _run(args)
    assert accepted.exit_code == 0 and "2 done (0 encoded now, 2 reused)" in accepted.output, accepted.output[-3000:]

    (src / "s.tar").unlink()
    make_shards(src, {"s": samples(b"clip 0, told again")})  # a done sample's caption changes: stale
    stale = _run(args)
    assert stale.exit_code == 1, stale.output[-3000:]
    error = _error(stale)
    assert error.startswith(f"error: StaleAborted: 1 done sample(s) of {out} changed in the source"), error
    assert sorted(re.findall(r"add to the same command --on-stale (\w+) to|, or --on-stale (\w+) to", error)) == [
        ("", "keep"),
        ("replace", ""),
    ], error
    kept_out = tmp_path / "kept"
    shutil.copytree(out, kept_out)
    kept = _run(_with(_with(args, "--out", str(kept_out)), "--on-stale", "keep"))
    assert kept.exit_code == 0 and "2 done (0 encoded now, 2 reused)" in kept.output, kept.output[-3000:]
    replaced = _run(_with(args, "--on-stale", "replace"))
    assert replaced.exit_code == 0 and "2 done (1 encoded now, 1 reused)" in replaced.output, replaced.output[-3000:]


def test_the_decode_gates_answer_runs_as_printed(cache, source, tiny_model, tmp_path):
    out = _copy(cache, tmp_path)
    args = _with(_build(source, tiny_model, out), "--frames", str(OLD_FRAMES))  # the cache's own spec: a resume
    args = _with(_with(args, "--decode-samples", "1"), "--min-psnr", "99")
    judged = _run(args)
    assert judged.exit_code == 1, judged.output[-3000:]
    error = _error(judged)
    assert "decode-verify: FAILED" in error and "look at the strips in" in error, error
    floor = re.search(r"to accept these numbers, add --min-psnr (\S+) to the same command", error).group(1)
    accepted = _run(_with(args, "--min-psnr", floor))
    assert accepted.exit_code == 0, accepted.output[-3000:]
    assert f"{SAMPLES} done (0 encoded now, {SAMPLES} reused)" in accepted.output
    assert "decode-verify: OK" in accepted.output


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FINGERPRINTS = st.sampled_from(["a" * 64, "b" * 64, "foreign"]) | st.none()


@settings(max_examples=200, deadline=None)
@given(
    meta=JSON
    | st.fixed_dictionaries(
        {"fingerprint": FINGERPRINTS, "provenance": JSON | st.dictionaries(st.just("replaces"), FINGERPRINTS | JSON)}
    ),
    done=st.dictionaries(FINGERPRINTS, st.integers(0, 5), max_size=3),
)
def test_an_overwrite_in_progress_is_read_from_any_cache_json_without_an_error(meta, done):
    """cache.json is the user's disk: whatever it holds, the overwrite in progress is a plain answer, never a crash,
    and only ever a fingerprint the ledgers hold done samples of that is not the cache's own."""
    found = overwrite_in_progress(meta, done)
    if found is not None:
        assert found["pending"] == done[found["from"]] > 0
        assert found["from"] != meta.get("fingerprint")
