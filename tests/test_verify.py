"""verify_out on real caches: every state, the spec differences, the sample check, and that it reads safely."""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.lock import LOCK_NAME
from infra.config import CacheSpec
from infra.demo.tiny import make_tiny_wan22
from infra.gates.verify import VerifyReport, verify_out
from infra.plan import make_spec
from tests.conftest import FRAMES, HEIGHT, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip

SHARDS = ("G-11_part-00000", "O-21_part-00000")


class Plant:
    """Unpickling this touches `marker`: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> dict[str, Any]:
    """One real cache: two shards, two groups, two samples each; and the planned spec that made it."""
    root = tmp_path_factory.mktemp("verify")
    videos = [cut_clip(clips["bikes"], 12, width=160), cut_clip(clips["carphone"], 12)]
    src = make_shards(
        root / "src",
        {
            SHARDS[0]: [sample(0, i, v, f"clip {i} of group zero".encode()) for i, v in enumerate(videos)],
            SHARDS[1]: [sample(1, i, v, f"clip {i} of group one".encode()) for i, v in enumerate(videos)],
        },
    )
    ok, result = run_build(config(src, tiny_model, root / "out"))
    assert ok and result["done"] == 4, result
    return {"src": src, "model": tiny_model, "out": root / "out", "plan": _plan(config(src, tiny_model, root / "out"))}


def _plan(cfg: Any) -> tuple[CacheSpec, tuple[int, ...], tuple[int, ...]]:
    _, spec, latent_shape, text_shape = make_spec(cfg)
    return spec, latent_shape, text_shape


def _verify(out: Path, plan: tuple[CacheSpec, tuple[int, ...], tuple[int, ...]], **kwargs: Any) -> VerifyReport:
    """verify_out, asserting that it changed nothing under OUT (or created it)."""
    before, existed = tree_hashes(out), out.exists()
    spec, latent_shape, text_shape = plan
    report = verify_out(out, spec, latent_shape=latent_shape, text_shape=text_shape, **kwargs)
    assert tree_hashes(out) == before and out.exists() == existed
    json.dumps(report.to_dict())
    assert report.markdown() and report.text()
    return report


def _copy(built: dict[str, Any], tmp_path: Path) -> Path:
    return Path(shutil.copytree(built["out"], tmp_path / "out"))


def _sample_paths(out: Path) -> list[Path]:
    rows = [r for rows in ledger.read_all(out).values() for r in rows.values() if r.status == "done"]
    return sorted(out / r.path for r in rows if r.path)


def test_absent(tmp_path, built):
    for out in (tmp_path / "missing", tmp_path / "empty", tmp_path / "locked"):
        if out.name != "missing":
            out.mkdir()
        if out.name == "locked":
            (out / LOCK_NAME).write_text("123")
        report = _verify(out, built["plan"])
        assert (report.kind, report.done, report.problems, report.sample_check) == ("absent", 0, [], None)
        assert "creates OUT" in report.text()


def test_foreign(tmp_path, built):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("someone else's files")
    (tmp_path / "file").write_text("a file, not a directory")
    for out in (tmp_path / "dir", tmp_path / "file"):
        report = _verify(out, built["plan"])
        assert report.kind == "foreign" and report.existing_fingerprint is None
        assert "does not write into a directory" in report.markdown()


def test_compatible_counts_groups_outputs_and_shapes(built):
    report = _verify(built["out"], built["plan"])
    assert report.kind == "compatible", report.problems
    assert report.existing_fingerprint == report.planned_fingerprint == built["plan"][0].fingerprint()
    assert report.done == 4 and "4 sample(s) done" in report.message
    assert report.groups == {
        "G-11_handle_object_reappearance_data-generator": 2,
        "O-21_ball_trajectory_data-generator": 2,
    }
    assert report.bytes == sum(p.stat().st_size for p in _sample_paths(built["out"]))
    assert report.outputs == {"latents": "present", "text_embeddings": "present"}
    assert report.differences == {} and report.problems == [] and len(report.checked) == 4
    check = report.sample_check
    assert check is not None and check["matches"] and check["differs"] == {}
    assert check["tensors"]["x0"] == {"shape": list(built["plan"][1]), "dtype": "torch.bfloat16"}
    assert check["tensors"]["text_embeds"] == {"shape": list(built["plan"][2]), "dtype": "torch.bfloat16"}
    markdown = report.markdown()
    assert "`compatible`" in markdown and "| samples done | 4 |" in markdown
    assert "| O-21_ball_trajectory_data-generator | 2 |" in markdown and "resumes" in markdown
    assert "model_identity.vae" in markdown and report.planned_fingerprint in report.text()
    # the UI's dialog: every table has a heading row, and no 64-digit fingerprint runs off it
    assert "| | |" not in markdown and "| what | value |" in markdown and "| group | samples |" in markdown
    assert report.planned_fingerprint not in markdown and f"{report.planned_fingerprint[:16]}…" in markdown


def test_sample_choice_is_spread_over_groups_and_deterministic(built):
    first = _verify(built["out"], built["plan"], max_samples=2)
    again = _verify(built["out"], built["plan"], max_samples=2)
    assert first.checked == again.checked and len(first.checked) == 2
    assert {path.split("/")[0] for path in first.checked} == set(first.groups)
    assert _verify(built["out"], built["plan"], max_samples=0).checked == []


def test_incompatible_names_the_differing_fields(tmp_path, built):
    other_model = make_tiny_wan22(tmp_path / "tiny-wan22-seven", seed=7)
    plan = _plan(config(built["src"], other_model, built["out"], frames=FRAMES + 4, dtype="bf16"))
    report = _verify(built["out"], plan)
    assert report.kind == "incompatible" and report.done == 4
    assert {"frames", "dtype", "model_identity"} <= set(report.differences)
    assert report.differences["frames"] == {"existing": FRAMES, "planned": FRAMES + 4}
    assert report.differences["dtype"] == {"existing": "fp32", "planned": "bf16"}
    assert "differs in: dtype, frames, model_identity.text_encoder, model_identity.vae" in report.message
    for preview in (report.markdown(), report.text()):
        assert "frames" in preview and f"{FRAMES} → {FRAMES + 4}" in preview
        assert "dtype" in preview and "fp32 → bf16" in preview and "model_identity.vae" in preview
        assert "stops before taking the lock" in preview
    assert (
        "| samples done | 4 |" in report.markdown()
        and "| O-21_ball_trajectory_data-generator | 2 |" in report.markdown()
    )


def test_sample_check_says_which_shape_differs(built):
    plan = _plan(config(built["src"], built["model"], built["out"], height=64))
    report = _verify(built["out"], plan)
    assert report.kind == "incompatible" and set(report.differences) == {"height"}
    check = report.sample_check
    assert check is not None and not check["matches"]
    assert set(check["differs"]) == {"x0.shape"}
    existing, planned = check["differs"]["x0.shape"]["existing"], check["differs"]["x0.shape"]["planned"]
    assert (existing[2], planned[2]) == (HEIGHT // 16, 64 // 16) and existing[3] == planned[3]
    assert "differs: x0.shape" in report.text() and "height" in report.markdown()


def test_a_sample_without_text_embeds_is_missing_that_output(tmp_path, built):
    out = _copy(built, tmp_path)
    path = _sample_paths(out)[0]
    record = torch.load(path, weights_only=True)
    del record["text_embeds"]
    torch.save(record, path)
    report = _verify(out, built["plan"])
    assert report.outputs == {"latents": "present", "text_embeddings": "missing"}
    assert report.kind == "damaged"
    assert any(str(path) in p and "'text_embeds'" in p for p in report.problems)


def test_a_planted_pickle_never_runs(tmp_path, built):
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Plant(proof)))
    assert proof.exists(), "the planted pickle must be live for this test to mean anything"
    out = _copy(built, tmp_path)
    marker = tmp_path / "marker"
    target = _sample_paths(out)[0]
    torch.save(Plant(marker), target)
    stray = out / target.parent.name / "stray.pt"
    stray.write_bytes(pickle.dumps(Plant(marker)))
    report = _verify(out, built["plan"])
    assert not marker.exists()
    assert report.kind == "damaged"
    assert any(p.startswith(f"{target}: does not load with weights_only=True") for p in report.problems)
    assert str(target) in report.markdown()


def test_a_truncated_sample_is_damage(tmp_path, built):
    out = _copy(built, tmp_path)
    target = _sample_paths(out)[-1]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    report = _verify(out, built["plan"])
    assert report.kind == "damaged" and report.done == 4
    assert any(p.startswith(f"{target}: does not load") for p in report.problems)
    assert any(p.startswith(f"{target}: ") and "bytes on disk" in p for p in report.problems)


def test_a_missing_sample_is_not_damage_but_is_listed(tmp_path, built):
    """Nothing is there to overwrite: a run re-encodes it, so no approval is needed."""
    out = _copy(built, tmp_path)
    target = _sample_paths(out)[1]
    target.unlink()
    report = _verify(out, built["plan"])
    assert report.kind == "compatible" and report.done == 4 and len(report.checked) == 3
    assert report.problems == [] and report.missing == [str(target)]
    assert "1 of them missing on disk" in report.message and str(target) in report.text()


@pytest.mark.parametrize("body", ["{not json", '{"spec": {"family": "wan22"}}', "[]"])
def test_an_unreadable_cache_json_is_damage(tmp_path, built, body):
    out = _copy(built, tmp_path)
    (out / "cache.json").write_text(body)
    report = _verify(out, built["plan"])
    assert report.kind == "damaged" and "cache.json" in report.message
    assert report.existing_spec is None and report.done == 4


def test_a_ledger_path_outside_out_is_never_read(tmp_path, built):
    out = _copy(built, tmp_path)
    marker = tmp_path / "marker"
    (tmp_path / "outside.pt").write_bytes(pickle.dumps(Plant(marker)))
    sealed = ledger.sealed_path(out, SHARDS[1])
    rows = [json.loads(line) for line in sealed.read_text().splitlines()]
    rows[0]["path"] = "../outside.pt"
    sealed.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = _verify(out, built["plan"])
    assert not marker.exists() and report.kind == "damaged" and len(report.checked) == 3
    assert any("has a path outside OUT ('../outside.pt')" in p for p in report.problems)


def test_an_unreadable_ledger_is_damage(tmp_path, built):
    out = _copy(built, tmp_path)
    sealed = ledger.sealed_path(out, SHARDS[0])
    sealed.write_text("{torn\n" + sealed.read_text())
    report = _verify(out, built["plan"])
    assert report.kind == "damaged" and report.done == 0
    assert any("unreadable ledger" in p for p in report.problems)


def _flip(path: Path, count: int = 64) -> None:
    """`count` bytes inverted in the middle of the file: the same size, other content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_damage_named_with_a_repair_that_works(tmp_path, built):
    """Before: 64 bytes flipped in a .pt (same size) passed verify and reconcile: a damaged cache called
    compatible. Now verify (every sha256) and reconcile name the sample; running the printed repair, then the build
    again, gives back the sample's bytes."""
    out = _copy(built, tmp_path)
    target = _sample_paths(out)[0]
    original = target.read_bytes()
    _flip(target)
    report = _verify(out, built["plan"], content="all")
    assert report.kind == "damaged" and len(report.damaged) == 1
    damaged = report.damaged[0]
    assert out / damaged["path"] == target and damaged["selector"] == f"{damaged['shard']}/{damaged['key']}"
    assert any(p.startswith(f"{target}: sha256 ") for p in report.problems)
    verified = CliRunner().invoke(app, ["verify", str(out)])
    assert verified.exit_code == 1 and "DAMAGED" in verified.output and damaged["selector"] in verified.output
    reconciled = CliRunner().invoke(app, ["reconcile", str(out)])
    assert reconciled.exit_code == 1 and "file_damaged" in reconciled.output
    assert CliRunner().invoke(app, ["reconcile", str(out), "--quick"]).exit_code == 0  # sizes only: not seen
    repair = [line.strip() for line in verified.output.splitlines() if line.strip().startswith(("mkdir ", "mv "))]
    assert len(repair) == 2, verified.output
    subprocess.run(["bash", "-c", "set -e\n" + "\n".join(repair)], check=True)
    assert not target.exists() and out.with_name("out.damaged").joinpath(damaged["path"]).is_file()
    ok, result = run_build(config(built["src"], built["model"], out))
    assert ok and (result["encoded"], result["reused"]) == (1, 3), result
    assert target.read_bytes() == original
    assert CliRunner().invoke(app, ["verify", str(out)]).exit_code == 0


def test_a_builds_spot_check_hashes_the_samples_it_loads(tmp_path, built):
    """verify-existing before a resume hashes only the samples it loads: flipped bytes in one of them are damage
    there too (the others are left to `latentforge verify`)."""
    out = _copy(built, tmp_path)
    report = _verify(out, built["plan"], max_samples=1)
    (checked,) = report.checked
    _flip(out / checked)
    assert _verify(out, built["plan"], max_samples=0).kind == "compatible"  # nothing loaded: sizes only
    spotted = _verify(out, built["plan"], max_samples=1)
    assert spotted.kind == "damaged" and [d["path"] for d in spotted.damaged] == [checked]
    assert "verify hashes all" in spotted.text()
