"""What a trainer will load is what the ledger knows: a file in OUT that the format's consumer would load by its own
glob (musubi-tuner's ``*_wan.safetensors``, DiffSynth-Studio's every ``.pth``, a ``.pt`` of the VBVR layout, a
webdataset part) but that no ledger row owns is named by ``verify``, ``reconcile`` and ``inspect``; a resume into
such an OUT stops with the conflict's answers (``--on-conflict reuse`` keeps it, an approved overwrite removes it);
upload never sends it. A file a run wrote for a sample it died on (its mark with no row) is not a stop: the resume
adopts it."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from infra.cache import ledger
from infra.config import UploadConfig
from infra.formats import FORMATS
from infra.publish.base import parse_target
from infra.publish.manifest import build_manifest
from tests.conftest import FRAMES, HEIGHT, WIDTH, make_shards, sample, tree_hashes
from tests.conftest import config as make_config

runner = CliRunner()
MUSUBI = {"recipe": "musubi-wan", "frames": 17, "width": 80, "height": 48}
#: format → (the model fixture, settings, the stray's OUT-relative path)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "pt": ("tiny_model", {}, "g-stray/copy.pt"),
    "musubi": ("wan21_model", MUSUBI, "stray_00000-017_0640x0272_wan.safetensors"),
    "diffsynth": (
        "wan21_model",
        {"recipe": "diffsynth-wan", "frames": 17, "width": 80, "height": 48},
        "extra/evil.pth",
    ),
    "webdataset": ("tiny_model", {"format": "webdataset"}, "shards/stray-00000.tar"),
}


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    samples = [sample(0, i, clips["bikes"], f"clip {i}".encode()) for i in range(2)]
    return make_shards(tmp_path_factory.mktemp("unowned-src"), {"shard-0": samples})


def _args(source: Path, model: Path, out: Path, settings: dict[str, Any], *more: str) -> list[str]:
    geometry = {"frames": FRAMES, "height": HEIGHT, "width": WIDTH, **settings}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in geometry.items()]
    return [
        "build",
        "--source",
        f"vbvr:{source}",
        "--model",
        str(model),
        "--out",
        str(out),
        *flags,
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--decode-samples",
        "0",
        "--on-stale",
        "abort",
        *more,
    ]


@pytest.fixture(scope="module")
def builds() -> dict[str, Path]:
    """A finished cache per format, built on first use (each test works on a copy)."""
    return {}


def _built(request: pytest.FixtureRequest, builds: dict[str, Path], fmt: str, out: Path) -> tuple[Path, dict]:
    """A copy at `out` of the format's finished cache of the module's source; (the model, the settings)."""
    model_fixture, settings, _ = CASES[fmt]
    model = request.getfixturevalue(model_fixture)
    if fmt not in builds:
        built = request.getfixturevalue("tmp_path_factory").mktemp(f"unowned-{fmt}") / "out"
        ok, result = run_build(make_config(request.getfixturevalue("source"), model, built, **settings))
        assert ok and result["done"] == 2, result
        builds[fmt] = built
    shutil.copytree(builds[fmt], out, symlinks=True)
    return model, settings


class _Opens:
    """What unpickling it does: opens (creates) a file, as a planted ``.pth`` that DiffSynth unpickles could."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.marker), "w")


def _plant(out: Path, fmt: str) -> str:
    """A file the consumer loads that no row owns: a copy of one of the cache's own (so it carries its marks), or
    for DiffSynth a pickle that creates a file beside OUT when it is unpickled."""
    rel = CASES[fmt][2]
    loads = FORMATS.get(fmt).consumer_glob.loads
    own = sorted(p for p in out.rglob("*") if p.is_file() and loads(p.relative_to(out).as_posix()))
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    if fmt == "diffsynth":
        (out / rel).write_bytes(pickle.dumps(_Opens(out.with_name("unpickled"))))
    else:
        shutil.copy(own[0], out / rel)
    return rel


@pytest.mark.parametrize("fmt", list(CASES))
def test_a_file_its_consumer_would_load_that_no_row_owns_is_named_stops_a_resume_and_is_never_sent(
    request, builds, source, tmp_path, fmt
):
    out = tmp_path / "out"
    model, settings = _built(request, builds, fmt, out)
    rel = _plant(out, fmt)
    stray = str(out / rel)

    verified = runner.invoke(app, ["verify", str(out)])
    assert verified.exit_code == 1 and stray in verified.output, verified.output
    assert "no ledger row owns" in verified.output and "--approve-overwrite" in verified.output
    reconciled = runner.invoke(app, ["reconcile", str(out)])
    assert stray in reconciled.output, reconciled.output
    inspected = runner.invoke(app, ["inspect", str(out)])
    assert inspected.exit_code == 0 and stray in inspected.output, inspected.output

    target = parse_target("s3://bucket/cache")
    manifest = build_manifest(out, UploadConfig(to=target.url), target)
    assert rel not in {f.path for f in manifest.files}

    before = tree_hashes(out)
    resumed = runner.invoke(app, _args(source, model, out, settings, "--on-conflict", "abort"))
    errors = [line for line in resumed.output.splitlines() if line.startswith("error:")]
    assert resumed.exit_code == 1 and len(errors) == 1, resumed.output
    assert stray in errors[0] and "--on-conflict reuse" in errors[0] and "--approve-overwrite" in errors[0], errors
    assert tree_hashes(out) == before  # nothing written, not even the lock

    kept = runner.invoke(app, _args(source, model, out, settings, "--on-conflict", "reuse"))
    assert kept.exit_code == 0, kept.output
    assert (out / rel).is_file() and not (tmp_path / "unpickled").exists()  # named, never read
    (decided,) = latest_run_report(out).decisions_at("conflict")
    assert decided.choice == "reuse" and decided.details["unowned"] == [rel], decided


def test_an_approved_overwrite_removes_the_files_no_row_owns_and_a_new_one_voids_it(request, builds, source, tmp_path):
    out = tmp_path / "out"
    model, settings = _built(request, builds, "pt", out)
    rel = _plant(out, "pt")
    verified = runner.invoke(app, ["verify", str(out)])
    token = re.search(r"--approve-overwrite (\w+)", verified.output)
    assert verified.exit_code == 1 and token, verified.output
    (out / "g-stray" / "second.pt").write_bytes((out / rel).read_bytes())  # after the preview: not approved
    refused = runner.invoke(app, _args(source, model, out, settings, "--approve-overwrite", token[1]))
    assert refused.exit_code == 1 and (out / rel).is_file(), refused.output
    (out / "g-stray" / "second.pt").unlink()
    approved = runner.invoke(app, _args(source, model, out, settings, "--approve-overwrite", token[1]))
    assert approved.exit_code == 0, approved.output
    assert not (out / rel).exists()
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


def test_a_file_written_for_the_sample_a_run_died_on_is_adopted_not_a_stop(request, builds, source, tmp_path):
    """The run died after the sample's file was linked, before its row: its mark, no row. The resume's gate lists the
    file apart (left by a run that died mid-sample), and the resume adopts it."""
    out = tmp_path / "out"
    model, settings = _built(request, builds, "pt", out)
    (shard,) = ledger.shard_ids(out)
    rows = ledger.read_shard(out, shard)
    last = sorted(rows)[-1]
    kept = [row for key, row in sorted(rows.items()) if key != last]
    ledger.seal(out, shard, kept)
    journal = out / "ledger" / f"{shard}.journal.jsonl"
    journal.write_text(json.dumps({"started": last, "pid": 1}) + "\n")
    leftover = rows[last].path
    verified = runner.invoke(app, ["verify", str(out), "--json"])
    report = json.loads(verified.output)
    assert report["in_flight"] == [leftover] and report["unowned"] == [], verified.output
    ok, result = run_build(make_config(source, model, out, **settings))
    assert ok and result["done"] == 2, result
    assert torch.load(out / leftover, weights_only=True)["id"] == rows[last].id
