"""Generated attacks on the records latentforge reads back (issue 53, point 6, for the records `infra.records` owns):
a finished small cache (the tiny model, 2 shards, built once) is copied per example, one of its records is corrupted
as an attacker would (truncated, inflated, re-nested, re-dated, fields swapped, a value of another type), then the
same build is run again (resume), and `verify` and `reconcile` are run, through the command line. After each:

* no traceback, and every command that fails names the corrupted file in what it prints (a ledger: one line that
  also names its repair; the recorded plan: one warning line, treated as absent; a lock record: a hold);
* nothing already done and intact is lost: every sample file is still there with its bytes, and every done row of a
  shard whose ledger was not touched is still done.

Examples are few (each runs three commands); one explicit example per record kind, then a few generated ones.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.lock import LOCK_NAME
from infra.records import MAX_DEPTH
from tests.conftest import HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip

FRAMES = 5
SHARDS = ("s0", "s1")

#: The records attacked, OUT-relative (the journal is made from a shard's ledger: a run killed before sealing it).
KINDS = {
    "ledger": "ledger/s0.jsonl",
    "journal": "ledger/s0.journal.jsonl",
    "plan index": "ledger/plan.json",
    "plan listing": "ledger/plan/s0.jsonl",
    "cache.json": "cache.json",
    "lock record": LOCK_NAME,
    "run report": "reports/RUN",
}
ODD_VALUES = st.sampled_from([True, None, -1, 10**30, 1e308, "soon", "9999-12-31T23:59:59+00:00", [], {}, "x" * 5000])


@pytest.fixture(scope="module")
def finished(clips, tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("attacks")
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(root / "src", {s: [sample(i, 0, video, f"clip of {s}".encode())] for i, s in enumerate(SHARDS)})
    out = root / "cache"
    ok, result = run_build(config(src, tiny_model, out, frames=FRAMES, workers=1))
    assert ok and result["done"] == len(SHARDS), result
    return {"src": src, "out": out, "model": tiny_model}


def _corrupt_value(value: Any, how: str, odd: Any, pick: int) -> Any:
    """A parsed record changed `how` (swap two fields, re-date its times, a value of another type)."""
    if not isinstance(value, dict) or not value:
        return [value, odd]
    keys = sorted(value)
    if how == "swap" and len(keys) > 1:
        a, b = keys[pick % len(keys)], keys[(pick + 1) % len(keys)]
        return {**value, a: value[b], b: value[a]}
    if how == "re-date":
        dated = [k for k in keys if isinstance(value[k], str) and re.match(r"\d{4}-\d\d-\d\d", value[k])]
        return {**value, **{k: odd for k in dated or keys[:1]}}
    return {**value, keys[pick % len(keys)]: odd}


def corrupt(data: bytes, how: str, pick: int, odd: Any) -> bytes:
    """`data` (a JSON document or JSON lines) corrupted `how`."""
    if how == "truncate":
        return data[: pick % max(len(data), 1)]
    if how == "inflate":
        return data + b"\n" + b'{"pad": "' + b"x" * (pick % 4096 + 1) * 512 + b'"}\n'
    if how == "re-nest":
        depth = MAX_DEPTH + 1 + pick % 5000
        lines = data.split(b"\n")
        at = pick % max(1, len([x for x in lines if x.strip()]))
        lines[at] = b"[" * depth + lines[at] + b"]" * depth
        return b"\n".join(lines)
    lines = data.split(b"\n")
    whole = len([x for x in lines if x.strip()]) <= 1 or data.lstrip().startswith(b"{\n")
    if whole:  # one JSON document
        return json.dumps(_corrupt_value(json.loads(data), how, odd, pick)).encode()
    at = pick % len([x for x in lines if x.strip()])
    lines[at] = json.dumps(_corrupt_value(json.loads(lines[at]), how, odd, pick)).encode()
    return b"\n".join(lines)


def _record_path(out: Path, kind: str) -> Path:
    rel = KINDS[kind]
    if kind == "journal":  # a run killed before it sealed s0: its rows in a journal over an empty ledger
        shutil.move(out / "ledger/s0.jsonl", out / rel)
    if kind == "lock record":  # a run of this host that did not release (its pid gone)
        gone = {"pid": 2**22 + 17, "host": socket.gethostname(), "create_time": 1.0, "since": "2026-01-01T00:00:00"}
        (out / rel).write_text(json.dumps(gone))
    if kind == "run report":
        rel = f"reports/{next(p.name for p in (out / 'reports').glob('run-*.json'))}"
    return out / rel


def _no_traceback(result: Result, what: str) -> None:
    assert "Traceback (most recent call last)" not in result.output, f"{what}: {result.output[-3000:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (what, repr(result.exception))
    assert len([line for line in result.output.splitlines() if line.startswith("error: ")]) <= 1, what


def _done(out: Path, shard: str) -> set[str]:
    try:
        return {k for k, r in ledger.read_shard(out, shard).items() if r.status == "done"}
    except ValueError:
        return set()


def _attack(
    finished: dict[str, Path], kind: str, how: str, pick: int, odd: Any, logs: pytest.LogCaptureFixture
) -> None:
    """The attack on a copy of the finished cache; what a command says is its output and its log lines (a warning
    goes to stderr on a terminal: a journal's torn last line, ignored, is named there)."""
    runner = CliRunner()
    with tempfile.TemporaryDirectory(prefix="lf-attack-") as tmp:
        out = Path(tmp) / "out"
        shutil.copytree(finished["out"], out)
        path = _record_path(out, kind)
        original = path.read_bytes()
        path.write_bytes(corrupt(original, how, pick, odd))
        samples = {p: p.read_bytes() for p in out.rglob("*.pt")}
        intact = {s: _done(finished["out"], s) for s in SHARDS if kind not in ("ledger", "journal") or s != "s0"}
        args = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
        build = ["build", "--source", f"vbvr:{finished['src']}", "--model", str(finished["model"]), "--out", str(out)]
        build += [*args, "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0"]
        build += ["--on-conflict", "abort", "--on-stale", "abort", "--on-loss", "abort"]
        # A ledger's row that reads back but says another thing than its file (a size of 1: `True` taken as 1) is
        # damage of its sample, named with the shard's ledger (`ledger/s0`) rather than the journal that holds it.
        shown = "ledger/s0" if kind in ("ledger", "journal") else str(path)
        for name, command in (
            ("verify", ["verify", str(out)]),
            ("reconcile", ["reconcile", str(out)]),
            ("resume", build),
        ):
            logs.clear()
            result = runner.invoke(app, command)
            _no_traceback(result, f"{name} after {how} of the {kind}")
            said = "\n".join([result.output, *(r.getMessage() for r in logs.records if r.levelname != "INFO")])
            # A journal cut at a line's end is what a run killed between two rows leaves: reconcile counts its
            # samples without a row (a shortfall, not a record it cannot read); the resume adopts their files.
            counted = result.output.startswith("reconcile: SHORTFALL") and "unreadable" not in result.output
            if result.exit_code != 0 and not counted:
                assert shown in said, f"{name} after {how} of the {kind} failed without naming {shown}: {said[-3000:]}"
        for sample_file, data in samples.items():  # nothing done and intact is lost
            assert sample_file.is_file() and sample_file.read_bytes() == data, sample_file
        for shard, keys in intact.items():
            assert keys <= _done(out, shard), (kind, how, shard)


HOWS = st.sampled_from(["truncate", "inflate", "re-nest", "re-date", "swap", "wrong type"])


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(kind="ledger", how="re-nest", pick=0, odd=None)
@example(kind="journal", how="wrong type", pick=1, odd=-1)
@example(kind="journal", how="truncate", pick=2000, odd=None)  # a torn last line: ignored, named, the sample redone
@example(kind="journal", how="truncate", pick=0, odd=None)  # emptied: a run killed before its first row
@example(kind="journal", how="re-date", pick=0, odd=True)  # no time in a row: its first field, `bytes`, made True
@example(kind="plan index", how="re-nest", pick=4000, odd=None)
@example(kind="plan listing", how="swap", pick=0, odd=None)
@example(kind="cache.json", how="re-nest", pick=3, odd=None)
@example(kind="cache.json", how="swap", pick=0, odd=True)  # its provenance a string: names no model
@example(kind="lock record", how="re-date", pick=0, odd=1e308)
@example(kind="run report", how="truncate", pick=100, odd=None)
@given(kind=st.sampled_from(sorted(KINDS)), how=HOWS, pick=st.integers(0, 10**6), odd=ODD_VALUES)
def test_a_corrupted_record_is_named_in_one_line_and_nothing_done_is_lost(finished, caplog, kind, how, pick, odd):
    _attack(finished, kind, how, pick, odd, caplog)


def test_corruptions_change_what_they_say(tmp_path):
    """The attacks themselves (a test of the test): each changes the record, and a re-nest goes past the bound."""
    record = json.dumps({"pid": 1, "since": "2026-01-01T00:00:00", "host": "h"}).encode()
    for how in ("truncate", "inflate", "re-nest", "re-date", "swap", "wrong type"):
        assert corrupt(record, how, 7, "soon") != record, how
    assert corrupt(record, "re-nest", 0, None).startswith(b"[" * (MAX_DEPTH + 1))
    assert json.loads(corrupt(record, "re-date", 0, "soon"))["since"] == "soon"


@pytest.mark.parametrize("rel", ["ledger/plan.json", "ledger/plan/s0.jsonl"])
def test_verify_reconcile_and_a_resume_treat_a_damaged_plan_by_one_rule_with_one_line(finished, tmp_path, caplog, rel):
    """One rule for a damaged recorded plan (it describes what the next build lists again): treated as absent, with
    the same warning line naming the file from `verify` and `reconcile` (and a resume, which records it anew), all
    exit 0. Before: verify said COMPATIBLE and nothing of the plan (exit 0), reconcile and the resume ended in
    `error: RecursionError: maximum recursion depth exceeded ...` (exit 1), naming no file."""
    out = tmp_path / "out"
    shutil.copytree(finished["out"], out)
    (out / rel).write_bytes(b"[" * 5000 + b"]" * 5000 + b"\n")
    what = "a plan index" if rel.endswith("plan.json") else "a planned sample"
    where = f"{out / rel}" + ("" if rel.endswith("plan.json") else ":1")
    line = f"{where}: not {what} (nested deeper than {MAX_DEPTH}); treated as absent: the source is listed again"
    args = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    build = ["build", "--source", f"vbvr:{finished['src']}", "--model", str(finished["model"]), "--out", str(out)]
    build += [*args, "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0"]
    said = {}
    for name, command in (("verify", ["verify", str(out)]), ("reconcile", ["reconcile", str(out)]), ("resume", build)):
        caplog.clear()
        result = CliRunner().invoke(app, command)
        _no_traceback(result, name)
        assert result.exit_code == 0, (name, result.output[-3000:])
        said[name] = [r.getMessage() for r in caplog.records if r.name == "infra.records"]
    assert len(said["verify"]) == 1 and said["verify"][0].startswith(line), said
    assert said["reconcile"] == said["verify"], said
    assert said["resume"] == (said["verify"] if rel.endswith("plan.json") else [])  # a listing is rewritten unread
    assert json.loads((out / "ledger/plan.json").read_text())["shards"]  # recorded anew
    assert (out / "ledger/plan/s0.jsonl").read_bytes() == (finished["out"] / "ledger/plan/s0.jsonl").read_bytes()


def test_the_repair_a_damaged_ledger_names_runs_as_printed_and_loses_nothing(finished, tmp_path):
    """`verify` names a damaged ledger with the command that repairs it; run as printed, then the same build: every
    sample kept, none encoded again (its files adopted: fingerprint, group and id checked)."""
    out = tmp_path / "out"
    shutil.copytree(finished["out"], out)
    (out / "ledger/s0.jsonl").write_bytes(b"[" * 5000 + b"]" * 5000 + b"\n")
    samples = {p: p.read_bytes() for p in out.rglob("*.pt")}
    verified = CliRunner().invoke(app, ["verify", str(out)])
    assert verified.exit_code == 1, verified.output[-3000:]
    named = r"ledger/s0\.jsonl:1: not a ledger line \(nested deeper than \d+\); move it out of OUT \((.+?)\) and run"
    repair = re.search(named, verified.output).group(1)
    subprocess.run(["bash", "-c", repair], check=True)
    args = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    build = ["build", "--source", f"vbvr:{finished['src']}", "--model", str(finished["model"]), "--out", str(out)]
    build += [*args, "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0"]
    resumed = CliRunner().invoke(app, build)
    assert resumed.exit_code == 0, resumed.output[-3000:]
    assert f"{len(SHARDS)} done (0 encoded now, {len(SHARDS)} reused)" in resumed.output, resumed.output[-3000:]
    assert {p: p.read_bytes() for p in out.rglob("*.pt")} == samples
    assert (tmp_path / "out.damaged/ledger/s0.jsonl").is_file()
