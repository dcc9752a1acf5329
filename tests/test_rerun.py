"""`latentforge rerun RUN_ID --failed-only`: a new run, same spec, that touches only what failed in RUN_ID."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.formats import get_format
from infra.plan import parse_only
from infra.sources import open_source
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip

runner = CliRunner()


def _paths_of(src: Path, shard: str) -> dict[str, str]:
    refs = open_source(f"vbvr:{src}").samples(next(s for s in open_source(f"vbvr:{src}").shards() if s.id == shard))
    return {ref.key: get_format("pt").paths(ref.stem, ["latents"])["latents"] for ref in refs}


def test_rerun_failed_only_touches_only_what_failed(tmp_path, tiny_model, clips):
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(
        tmp_path / "src",
        {
            "a": [sample(0, i, video, f"clip {i}".encode()) for i in range(3)],
            "b": [sample(1, 0, video, b"fine"), sample(1, 1, b"not a video at all", b"corrupt")],
        },
    )
    out = tmp_path / "out"
    ok, first = run_build(config(src, tiny_model, out, max_samples_per_shard=1))
    assert ok and first["done"] == 2, first
    # A stray file where a.1 will be written (say, from another encoder): the run must not overwrite it.
    keys = sorted(_paths_of(src, "a"))
    stray = out / _paths_of(src, "a")[keys[1]]
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"somebody else's file")
    ok, stopped = run_build(config(src, tiny_model, out))  # a file a trainer would load that no row owns: a stop
    assert not ok and "no ledger row owns" in str(stopped), stopped
    ok, second = run_build(config(src, tiny_model, out, on_conflict="reuse"))  # kept, as the person decided
    assert ok, second
    rows = ledger.read_all(out)
    assert rows["a"][keys[1]].status == "failed" and rows["a"][keys[1]].reason == "output_exists"
    assert {r.status for k, r in rows["b"].items()} == {"done", "skipped"}
    run_id = json.loads(Path(second["run_report"]).read_text())["flow_run_id"]
    assert rows["a"][keys[1]].extra["run_id"] == run_id

    stray.unlink()  # the person removes the stray file, then reruns what failed
    before = tree_hashes(out)
    dry = runner.invoke(app, ["rerun", run_id, "--failed-only", "--dry-run"])
    assert dry.exit_code == 0 and f'["a/{keys[1]}"]' in dry.output, dry.output
    assert tree_hashes(out) == before

    result = runner.invoke(app, ["rerun", run_id, "--failed-only"])
    assert result.exit_code == 0, result.output
    after = tree_hashes(out)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed == {str(stray.relative_to(out)), "ledger/a.jsonl"}, changed
    rows_after = ledger.read_all(out)
    assert rows_after["a"][keys[1]].status == "done"
    assert rows_after["a"][keys[1]].extra["run_id"] != run_id
    unchanged = {(s, k) for s in rows for k in rows[s] if (s, k) != ("a", keys[1])}
    assert all(rows_after[s][k] == rows[s][k] for s, k in unchanged)  # the skipped b sample was not retried

    again = runner.invoke(app, ["rerun", run_id, "--failed-only"])  # what failed there is done now
    assert again.exit_code == 0 and "nothing to rerun" in again.output


def test_rerun_needs_failed_only_and_a_build_run():
    assert runner.invoke(app, ["rerun", "00000000-0000-0000-0000-000000000000"]).exit_code == 2
    missing = runner.invoke(app, ["rerun", "00000000-0000-0000-0000-000000000000", "--failed-only"])
    assert missing.exit_code == 2 and "cannot rerun" in missing.output


def test_only_selectors_parse():
    assert parse_only(None) is None
    assert parse_only(["a", "b/x/y", "b/z", "a/k"]) == {"a": None, "b": frozenset({"x/y", "z"})}
