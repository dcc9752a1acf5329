"""Every sample accounted for, and counts that are true (issue 38): the plan is what reconciliation expects, a shard
deleted or cut mid-run leaves a row per planned sample, a read-only OUT stops the run with one line, a crashed
shard's samples are counted failed, and a sample is blamed only on proof: those in flight when runs were killed are
decoded alone in a child, and only one every such child dies on is recorded failed instead of killing the next run.
Real builds over real clips with the tiny Wan2.2 model; moments chosen with the kill and hold points of
`infra.faults`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from infra.cache import ledger, listing
from infra.faults import ENV, FAIL_ENV, HOLD_ENV, KILL_ON_ENV, LOG_ENV
from infra.plan import make_plan, recorded_plan
from infra.preprocess.alone import SUSPECT_POINT
from infra.preprocess.inflight import KILLED_RUN, PROOF
from infra.preprocess.one_sample import IN_PROGRESS, prepare_sanity_dir, sanity_dir
from infra.publish.manifest import gate_problems
from infra.sources import ShardReadError, open_source
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.procs import cli_env
from tests.steps import reconciled

LATENTFORGE = Path(sys.executable).parent / "latentforge"
WAIT_S = 120.0


@pytest.fixture(scope="module")
def video(clips: dict[str, bytes]) -> bytes:
    return cut_clip(clips["carphone"], 9, width=96)


def _source(root: Path, video: bytes, sizes: dict[str, int], group: int | None = None) -> Path:
    """VBVR tars {name: samples}, every sample its own id; groups alternate unless one `group` is given."""
    first, shards = 0, {}
    for name, count in sizes.items():
        shards[name] = [
            sample(i % 2 if group is None else group, first + i, video, b"a man talks") for i in range(count)
        ]
        first += count
    return make_shards(root, shards)


def _listed_now(cfg) -> dict[str, list[str]]:
    """Each shard's sample keys as the source lists them now: what a run started now plans."""
    plan = make_plan(cfg)
    source, listed = open_source(plan.config.source, plan.spec), {}
    for shard in plan.shards:
        keys = listed[shard.id] = []
        with contextlib.suppress(ShardReadError):  # a cut shard: what it lists before the cut
            for ref in source.samples(shard.shard):
                keys.append(ref.key)
    return listed


def _recorded(out: Path) -> dict[str, list[str]]:
    """The plan the build recorded in OUT: each shard's planned sample keys."""
    return {e["id"]: [key for key, _, _ in listing.read_listing(out, e["id"]) or []] for e in listing.read_index(out)}


def _sealed_lines(out: Path, shard: str) -> list[dict]:
    return [json.loads(line) for line in ledger.sealed_path(out, shard).read_text().splitlines()]


def _assert_each_planned_sample_has_one_row(out: Path, planned: dict[str, list[str]]) -> None:
    """Every planned sample (`planned`: the source as listed when the run began): exactly one sealed row, with a
    reason unless done; no journal left; the plan the build recorded is that one."""
    assert planned and not list(ledger.ledger_dir(out).glob("*.journal.jsonl"))
    for shard, keys in planned.items():
        lines = Counter(row["key"] for row in _sealed_lines(out, shard))
        assert all(lines[key] == 1 for key in keys), (shard, keys, lines)
        rows = ledger.read_shard(out, shard)
        assert all(rows[key].status == "done" or rows[key].reason for key in keys)
    assert _recorded(out) == planned


def _upset_mid_run(cfg, moment: int, upset: Callable[[], None], tmp: Path) -> tuple[bool, object]:
    """Run the build held at its `moment`-th journalled sample, `upset` the source or OUT there, let it go on."""
    hold, log = tmp / "hold", tmp / "points.log"
    hold.touch()
    log.write_text("")
    done = threading.Event()

    def act() -> None:
        deadline = time.monotonic() + WAIT_S
        while log.read_text().count("sample\n") < moment and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            upset()
        finally:  # whatever the upset did, the build goes on
            hold.unlink()

    actor = threading.Thread(target=act, daemon=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HOLD_ENV, f"sample:{moment}={hold}")
        mp.setenv(LOG_ENV, str(log))
        actor.start()
        try:
            return run_build(cfg)
        finally:
            done.set()
            actor.join(timeout=30)


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 3)


UPSETS: dict[str, Callable[[Path], None]] = {"delete": Path.unlink, "truncate": _cut}


@pytest.mark.parametrize(("upset", "reason"), [("delete", "shard_vanished"), ("truncate", "shard_changed")])
def test_a_shard_deleted_or_cut_mid_run_is_a_row_per_planned_sample_and_a_shortfall_upload_refuses(
    tmp_path, tiny_model, video, upset, reason
):
    src = _source(tmp_path / "src", video, {"a": 3, "b": 3, "c": 3})
    cfg = config(src, tiny_model, tmp_path / "out", workers=1, on_loss="abort")
    planned = _listed_now(cfg)
    ok, result = _upset_mid_run(cfg, 1, lambda: UPSETS[upset](src / "c.tar"), tmp_path)

    assert not ok and "3 sample(s) missing" in str(result), result  # the loss gate saw the shortfall
    _assert_each_planned_sample_has_one_row(cfg.out, planned)
    assert {row.reason for row in ledger.read_shard(cfg.out, "c").values()} == {reason}
    report = latest_run_report(cfg.out)
    assert (report.reconciliation.expected, report.reconciliation.produced) == (9, 6)
    assert report.reconciliation.reasons == {reason: 3}
    assert "3 sample(s) missing and nobody accepted the loss" in " ".join(gate_problems(cfg.out, report.fingerprint))
    later = reconciled(recorded_plan(cfg))  # `latentforge reconcile OUT`, in another process: the same plan
    assert (later.expected, later.produced, later.reasons()) == (9, 6, {reason: 3})


def test_a_shard_added_mid_run_is_not_counted_and_the_next_run_plans_it(tmp_path, tiny_model, video):
    src = _source(tmp_path / "src", video, {"a": 2, "b": 2})
    cfg = config(src, tiny_model, tmp_path / "out", workers=1)
    late = [sample(0, 90, video, b"added after the plan")]
    ok, result = _upset_mid_run(cfg, 1, lambda: make_shards(src, {"z": late}), tmp_path)
    assert ok and (result["samples"], result["done"]) == (4, 4), result
    assert latest_run_report(cfg.out).reconciliation.expected == 4  # the plan's: z came after it
    assert not ledger.sealed_path(cfg.out, "z").exists()
    ok, result = run_build(cfg)
    assert ok and (result["samples"], result["encoded"], result["reused"]) == (5, 1, 4), result
    assert latest_run_report(cfg.out).reconciliation.expected == 5


def _refuse_writes(folder: Path) -> Callable[[], None]:
    """Make `folder` refuse new files, as a user's chmod does (root passes through modes: the immutable flag there);
    returns the undo."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=True)
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_read_only_folder_mid_run_stops_the_run_with_one_line_and_the_same_command_resumes(
    tmp_path, tiny_model, video
):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    try:
        _refuse_writes(scratch)()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"no folder can be made to refuse this process's writes here (root without chattr: {exc})")
    src = _source(tmp_path / "src", video, {"a": 3, "b": 3}, group=0)
    cfg = config(src, tiny_model, tmp_path / "out", workers=1)
    undo: list[Callable[[], None]] = []

    def refuse() -> None:  # the group folder of the first sample, once it is journalled
        undo.append(_refuse_writes(next(d for d in Path(cfg.out).iterdir() if d.name.startswith("G-"))))

    try:
        ok, result = _upset_mid_run(cfg, 1, refuse, tmp_path)
    finally:
        for step in undo:
            step()
    assert undo, "the folder was not made read-only"
    assert not ok and str(result).count("OUT not writable") == 1, result
    assert "run the same command again: it resumes" in str(result)
    rows = [row for rows in ledger.read_all(cfg.out).values() for row in rows.values()]
    assert rows and all(row.status == "done" for row in rows), [(r.key, r.status, r.reason) for r in rows]
    ok, result = run_build(cfg)
    assert ok and result["done"] == 6 and result["failed"] == 0, result


def test_a_shard_whose_encodes_fail_crashes_and_every_count_agrees_with_the_ledger(
    tmp_path, tiny_model, video, monkeypatch
):
    src = _source(tmp_path / "src", video, {"a": 2, "b": 4})
    cfg = config(src, tiny_model, tmp_path / "out", workers=1)
    monkeypatch.setenv(
        FAIL_ENV, "encode:4"
    )  # the sanity's, a's two, then every encode from b's first on: a broken device
    ok, result = run_build(cfg)
    assert ok, result  # --on-loss accept: the shortfall is accepted, and counted
    rows = [row for rows in ledger.read_all(cfg.out).values() for row in rows.values()]
    b = Counter((r.status, r.reason) for r in rows if r.shard == "b")
    assert b == {("failed", "encode_error"): 3, ("failed", "shard_crashed"): 1}, b
    assert (result["samples"], result["done"], result["failed"]) == (6, 2, 4), result
    assert "crashed" in result["shard_errors"]["b"]
    report = latest_run_report(cfg.out)
    assert report.counts["failed"] == 4 and report.reconciliation.shortfall == 4
    assert report.reconciliation.reasons == {"encode_error": 3, "shard_crashed": 1}
    (loss,) = report.decisions_at("loss")
    assert loss.choice == "accept_loss" and loss.details["shortfall"] == 4


# --- a sample that kills the run -------------------------------------------------------------------------------


def _killed_cli(cmd: list[str], env: dict[str, str], logs: Path, name: str) -> str:
    """Run the CLI build, which a kill point ends with SIGKILL (its whole session after it); its stderr."""
    with (logs / f"{name}.err").open("wb") as stderr:
        proc = subprocess.run(
            cmd, env=env, cwd=logs, stdout=subprocess.DEVNULL, stderr=stderr, timeout=400, check=False
        )
    text = (logs / f"{name}.err").read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"{name}: exit {proc.returncode}, not the kill:\n{text[-3000:]}"
    return text


def _in_progress(out: Path, shard: str) -> dict[str, int]:
    """Sample key → how many runs died with it in progress (its marks with no row after them)."""
    marks: ledger.Marks = {}
    ledger.read_shard(out, shard, marks)
    return {key: len(found) for key, found in marks.items()}


@pytest.mark.soak  # tens of seconds of real builds: make soak (the suite stays under 15 minutes)
def test_samples_in_flight_at_two_kills_are_not_blamed_and_one_that_kills_its_child_is_failed_on_proof(
    tmp_path, tiny_model, video, monkeypatch
):
    src = _source(tmp_path / "src", video, {"a": 4, "z": 2})
    out, home = tmp_path / "out", tmp_path / "home"
    planned = _listed_now(config(src, tiny_model, out))
    cmd = [
        str(LATENTFORGE), "build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(out),
        "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu", "--dtype", "fp32",
        "--workers", "1", "--decode-samples", "0", "--on-loss", "accept",
    ]  # fmt: skip
    # 1. killed from outside mid-decode of a's second sample (the sanity's decode, a's first, then it), read-ahead
    # ones in flight
    _killed_cli(cmd, cli_env(home, **{ENV: "decode:2"}), tmp_path, "first")
    first = _in_progress(out, "a")
    assert len(first) >= 1 and set(first.values()) == {1}, first
    (src / "z.tar").unlink()  # and a shard the killed run planned and never reached vanishes before the resume
    # 2. the resume decodes each of them alone, in a child; it is killed from outside once the first is back (the
    # sanity has none to try: a's are suspects, z is gone)
    _killed_cli(cmd, cli_env(home, **{ENV: "decode:1"}), tmp_path, "second")
    twice = sorted(key for key, deaths in _in_progress(out, "a").items() if deaths == 2)
    assert twice, _in_progress(out, "a")
    # 3. two kills from outside blame nobody; a sample whose every child dies (a decoder crash on its bytes) is failed
    bad = twice[0]
    monkeypatch.setenv(KILL_ON_ENV, f"{SUSPECT_POINT}:SIGSEGV={bad}")
    ok, result = run_build(config(src, tiny_model, out, workers=1))
    assert ok, result
    rows = ledger.read_shard(out, "a")
    killed = rows[bad]
    assert (killed.status, killed.reason, killed.extra[PROOF]["signal"]) == ("failed", KILLED_RUN, "SIGSEGV"), killed
    assert f"latentforge rerun {result['run_id']} --failed-only" in killed.detail and "SIGSEGV" in killed.detail
    assert all(row.status == "done" for key, row in rows.items() if key != bad), rows
    assert {row.reason for row in ledger.read_shard(out, "z").values()} == {"shard_vanished"}  # planned by run 1
    assert (result["done"], result["failed"], result["skipped"]) == (3, 1, 2), result
    _assert_each_planned_sample_has_one_row(out, planned)
    assert latest_run_report(out).reconciliation.expected == 6


# --- generated attacks -------------------------------------------------------------------------------------------


def _upset(path: Path, how: str) -> None:
    if how == "grow":
        with path.open("ab") as fh:
            fh.write(bytes(1024))
    elif how != "keep":
        UPSETS[how](path)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    upsets=st.lists(st.sampled_from(["keep", "delete", "truncate", "grow"]), min_size=3, max_size=3),
    moment=st.integers(min_value=1, max_value=4),
)
def test_generated_deletions_and_cuts_mid_run_leave_one_row_per_planned_sample_and_a_resume_completes(
    upsets, moment, tiny_model, video, tmp_path_factory
):
    root = tmp_path_factory.mktemp("generated")
    src = _source(root / "src", video, {"a": 2, "b": 2, "c": 2})
    cfg = config(src, tiny_model, root / "out", workers=1, on_stale="keep")  # a done sample's shard cut: kept
    tars = [src / f"{name}.tar" for name in "abc"]
    planned = _listed_now(cfg)
    ok, result = _upset_mid_run(
        cfg, moment, lambda: [_upset(t, how) for t, how in zip(tars, upsets, strict=True)], root
    )
    assert ok, result
    _assert_the_plan_is_what_is_counted(cfg, planned)
    planned = _listed_now(cfg)
    ok, result = run_build(cfg)  # the resume, over what the source is now
    assert ok, result
    _assert_the_plan_is_what_is_counted(cfg, planned)


def _assert_the_plan_is_what_is_counted(cfg, planned: dict[str, list[str]]) -> None:
    """One sealed row per planned sample, and the run's reconciliation and `latentforge reconcile` expect the plan."""
    _assert_each_planned_sample_has_one_row(cfg.out, planned)
    expected = sum(map(len, planned.values()))
    assert latest_run_report(cfg.out).reconciliation.expected == expected
    assert reconciled(recorded_plan(cfg)).expected == expected


def test_a_sample_the_sanity_died_on_is_decoded_alone_by_the_next_sanity_and_passed_over_only_on_proof(
    tmp_path, tiny_model, video, monkeypatch
):
    src = _source(tmp_path / "src", video, {"a": 2})
    cfg = config(src, tiny_model, tmp_path / "out", workers=1)
    first = _listed_now(cfg)["a"][0]
    scratch = sanity_dir(Path(cfg.out))  # what a sanity killed on `first` leaves: its scratch, its mark
    prepare_sanity_dir(scratch)
    (scratch / IN_PROGRESS).write_text(first)
    monkeypatch.setenv(KILL_ON_ENV, f"{SUSPECT_POINT}={first}")  # every child that decodes it dies
    ok, result = run_build(cfg)
    assert ok and result["done"] == 2, result  # the shard builds it (in this process: no kill point there)
    (key, why), *_ = result["sanity"]["skipped_before"]
    assert key == first and why.startswith(KILLED_RUN)
    assert result["sanity"]["sample_key"] != first and not (scratch / IN_PROGRESS).exists()
    # killed from outside, a sanity blames nobody: its sample is decoded alone once more, and taken
    monkeypatch.delenv(KILL_ON_ENV)
    cfg = config(src, tiny_model, tmp_path / "again", workers=1)
    scratch = sanity_dir(Path(cfg.out))
    prepare_sanity_dir(scratch)
    (scratch / IN_PROGRESS).write_text(first)
    ok, result = run_build(cfg)
    assert ok and result["done"] == 2 and result["sanity"]["skipped_before"] == [], result
    assert result["sanity"]["sample_key"] == first and not (scratch / IN_PROGRESS).exists()
