"""Integrity: the fingerprint sees every weight, the ledger sees every input.

Model identity hashes every byte (remembered per file, taken from a Hub download's records where they exist);
each ledger row records what its sample was made from, so a revised source is stale, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from infra.cache import ledger
from infra.cache.cachedir import write_cache_json
from infra.config import ADDED_LATER, FINGERPRINT_NAMES, fingerprint_of
from infra.demo.data import write_vbvr_tar
from infra.gates.verify import verify_out
from infra.models import get_family, model_identity
from infra.models import identity as ident
from infra.plan import make_plan, make_spec
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.steps import reconciled, verified

VAE_TENSOR = "encoder.down_blocks.2.resnets.0.conv1.bias"
TEXT_TENSOR = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
WAN = get_family("wan22")


def _nudge(model: Path, component: str, filename: str, tensor: str) -> None:
    """Add 1e-3 to one tensor of one weight file (a partial fine-tune), keeping every other byte's meaning."""
    path = model / component / filename
    tensors = load_file(path)
    tensors[tensor] = tensors[tensor] + 1e-3
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("component", "filename", "tensor"),
    [("vae", "diffusion_pytorch_model.safetensors", VAE_TENSOR), ("text_encoder", "model.safetensors", TEXT_TENSOR)],
)
def test_one_changed_tensor_changes_the_fingerprint_and_names_the_component(
    tmp_path, tiny_model, component, filename, tensor
):
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_model, tuned)
    _nudge(tuned, component, filename, tensor)
    # latentforge 0.1's sampled identity missed it (the tensor lies outside its three 64 KiB windows) ...
    assert model_identity(tuned, WAN, "sampled")[component] == model_identity(tiny_model, WAN, "sampled")[component]
    out = tmp_path / "out"
    _, spec, latent, text = make_spec(config(tmp_path, tiny_model, out))
    _, tuned_spec, _, _ = make_spec(config(tmp_path, tuned, out))
    assert tuned_spec.fingerprint() != spec.fingerprint()  # ... every byte is seen now
    write_cache_json(out, spec, {})
    report = verify_out(out, tuned_spec, latent_shape=latent, text_shape=text)
    assert report.kind == "incompatible"
    assert report.message.endswith(f"differs in: model_identity.{component}")


def test_the_hash_cache_makes_a_second_plan_read_no_weight_bytes(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = config(tmp_path, tiny_model, tmp_path / "out")
    monkeypatch.setattr(ident, "stats", dict.fromkeys(ident.stats, 0))
    first = make_spec(cfg)[1]
    weights = sum(p.stat().st_size for p in tiny_model.rglob("*.safetensors") if p.parent.name in WAN.components)
    assert ident.stats["bytes_hashed"] >= weights
    monkeypatch.setattr(ident, "stats", dict.fromkeys(ident.stats, 0))
    assert make_spec(cfg)[1] == first
    assert ident.stats == {"bytes_hashed": 0, "files_hashed": 0, "files_known": 0}
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)  # another file (path, inode): hashed again, and the same identity
    assert model_identity(copy, WAN) == first.model_identity and ident.stats["files_hashed"] > 0


def _as_hub_snapshot(model: Path, root: Path) -> Path:
    """`model` laid out as a Hugging Face cache: snapshot files are symlinks into blobs/, LFS blobs (the weights)
    named by their sha256, the others by their git blob id."""
    blobs, snapshot = root / "blobs", root / "snapshots" / ("0" * 40)
    blobs.mkdir(parents=True)
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        data = path.read_bytes()
        lfs = path.suffix == ".safetensors"
        name = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (blobs / name).write_bytes(data)
        link = snapshot / path.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blobs / name, link.parent))
    return snapshot


def test_a_hub_snapshot_and_a_local_dir_download_take_the_recorded_hashes(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path / "cache"))
    plain = model_identity(tiny_model, WAN)
    snapshot = _as_hub_snapshot(tiny_model, tmp_path / "models--org--tiny")
    monkeypatch.setattr(ident, "stats", dict.fromkeys(ident.stats, 0))
    assert model_identity(snapshot, WAN) == plain
    weights = [p for p in snapshot.rglob("*.safetensors") if p.parent.name in WAN.components]
    assert ident.stats["files_known"] == len(weights) == 2
    assert ident.stats["bytes_hashed"] < 200_000  # configs and the tokenizer only, not the 4 MB of weights

    local = tmp_path / "local"
    shutil.copytree(tiny_model, local)
    vae = local / "vae" / "diffusion_pytorch_model.safetensors"
    record = local / ".cache" / "huggingface" / "download" / "vae" / "diffusion_pytorch_model.safetensors.metadata"
    record.parent.mkdir(parents=True)
    record.write_text(f"{'0' * 40}\n{hashlib.sha256(vae.read_bytes()).hexdigest()}\n{vae.stat().st_mtime + 5}\n")
    monkeypatch.setattr(ident, "stats", dict.fromkeys(ident.stats, 0))
    assert model_identity(local, WAN) == plain and ident.stats["files_known"] == 1

    blob = (snapshot / "vae" / "diffusion_pytorch_model.safetensors").resolve()
    blob.write_bytes(blob.read_bytes()[:-1000])  # a cut-off download keeps its blob name: not trusted, hashed
    assert model_identity(snapshot, WAN)["vae"] != plain["vae"]


def _sources(
    root: Path, clips: dict[str, bytes], prompts: tuple[bytes, bytes], second_video: bytes | None = None
) -> Path:
    video = cut_clip(clips["carphone"], 9)
    first = [sample(0, 0, video, prompts[0]), sample(0, 1, second_video or video, prompts[1])]
    for name in ("a.tar", "b.tar"):
        (root / name).unlink(missing_ok=True)
    write_vbvr_tar(root / "a.tar", first)
    write_vbvr_tar(root / "b.tar", [sample(1, 0, video, b"a third clip")])
    return root


def _files(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(out).items() if k.endswith(".pt")}


def test_a_changed_prompt_or_video_is_stale_stops_the_run_and_is_replaced_or_kept(tmp_path, tiny_model, clips):
    src = tmp_path / "src"
    src.mkdir()
    _sources(src, clips, (b"a man talks", b"a man listens"))
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out))
    assert ok and result["done"] == 3, result
    before = _files(out)
    first = ledger.read_shard(out, "a")
    row = next(iter(first.values()))
    assert set(row.source.members) == {"ground_truth.mp4", "prompt.txt"} and set(row.source.read_sha256) == set(
        row.source.members
    )
    assert row.source.read_sha256["prompt.txt"] == hashlib.sha256(b"a man talks").hexdigest()

    _sources(src, clips, (b"a man talks on the phone", b"a man listens"))  # an upstream revision of one prompt
    plan = make_plan(config(src, tiny_model, out))
    report = verified(plan)
    assert report.kind == "compatible" and [s["id"] for s in report.stale] == ["handle_object_reappearance_00000000"]
    assert report.stale[0]["changed"] == {"prompt.txt": "size 11 → 24"} and "stale" in report.text()
    ok, refused = run_build(config(src, tiny_model, out))  # no one can answer here: abort
    assert not ok and "changed in the source" in refused and _files(out) == before

    ok, result = run_build(config(src, tiny_model, out, on_stale="replace"))
    assert ok and result["encoded"] == 1 and result["reused"] == 2, result
    after = _files(out)
    changed = [k for k in before if after[k] != before[k]]
    assert changed == [next(k for k in before if k.endswith("_00000000.pt") and "handle_object" in k)]
    (decision,) = latest_run_report(out).decisions_at("stale")
    assert (decision.choice, decision.how, decision.details["samples"]) == (
        "replace_stale",
        "policy",
        [report.stale[0]["selector"]],
    )
    assert verified(make_plan(config(src, tiny_model, out))).stale == []

    _sources(src, clips, (b"a man talks on the phone", b"a man listens"), second_video=cut_clip(clips["bikes"], 9))
    stale = verified(make_plan(config(src, tiny_model, out))).stale
    assert [s["changed"] for s in stale] == [{"ground_truth.mp4": stale[0]["changed"]["ground_truth.mp4"]}]
    ok, result = run_build(config(src, tiny_model, out, on_stale="keep"))
    assert ok and result["encoded"] == 0 and result["stale_kept"] == 1, result
    assert _files(out) == after  # keep changes no sample file ...
    (decision,) = latest_run_report(out).decisions_at("stale")
    assert decision.choice == "keep" and decision.details["count"] == 1  # ... and is recorded
    again = verified(make_plan(config(src, tiny_model, out)))
    assert again.stale == [] and again.stale_kept == 1  # a kept change is not asked again


def test_a_repacked_shard_with_the_same_bytes_is_not_stale(tmp_path, tiny_model, clips):
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(tmp_path / "src", {"a": [sample(0, 0, video, b"a man talks")]})
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out))
    assert ok, result
    import infra.demo.data as data  # noqa: PLC0415

    (src / "a.tar").unlink()
    original = data._MTIME
    data._MTIME = original + 3600  # the same members, packed again an hour later
    try:
        write_vbvr_tar(src / "a.tar", [sample(0, 0, video, b"a man talks")])
    finally:
        data._MTIME = original
    report = verified(make_plan(config(src, tiny_model, out)))
    assert report.stale == []
    ok, result = run_build(config(src, tiny_model, out))
    assert ok and result["reused"] == 1 and result["encoded"] == 0, result
    (row,) = ledger.read_shard(out, "a").values()
    assert row.source.members["prompt.txt"].mtime == original + 3600  # the listing is brought up to date


def test_samples_gone_from_the_source_are_reported_and_kept(tmp_path, tiny_model, clips):
    src = tmp_path / "src"
    src.mkdir()
    _sources(src, clips, (b"one", b"two"))
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out))
    assert ok and result["done"] == 3, result
    before = _files(out)
    (src / "a.tar").unlink()
    write_vbvr_tar(src / "a.tar", [sample(0, 0, cut_clip(clips["carphone"], 9), b"one")])  # sample 1 removed
    (src / "b.tar").unlink()  # a whole shard removed
    report = reconciled(make_plan(config(src, tiny_model, out, shard_filter="a")))
    assert report.ok
    gone = sorted((g.shard, g.id) for g in report.gone_from_source)
    assert gone == [("a", "handle_object_reappearance_00000001"), ("b", "ball_trajectory_00000000")]
    assert "gone from the source" in report.text()
    assert _files(out) == before  # nothing deleted


def test_a_cache_of_the_sampled_identity_is_incompatible_not_damaged_and_can_be_reused(tmp_path, tiny_model, clips):
    src = make_shards(tmp_path / "src", {"a": [sample(0, i, cut_clip(clips["carphone"], 9), b"a man") for i in (0, 1)]})
    out = tmp_path / "out"
    ok, result = run_build(config(src, tiny_model, out, identity_scheme="sampled"))  # as latentforge 0.1 made it
    assert ok, result
    spec = json.loads((out / "cache.json").read_text())["spec"]
    as_in_0_1 = {  # the fields 0.1 had, under its names
        FINGERPRINT_NAMES.get(k, k): v for k, v in spec.items() if k not in ADDED_LATER or v != ADDED_LATER[k]
    }
    assert "identity_scheme" not in as_in_0_1 and fingerprint_of(as_in_0_1) == result["fingerprint"]
    report = verified(make_plan(config(src, tiny_model, out)))
    assert report.kind == "incompatible" and report.problems == []
    assert report.differences["identity_scheme"] == {"existing": "sampled", "planned": "content"}
    before = tree_hashes(out)
    ok, result = run_build(config(src, tiny_model, out, on_conflict="reuse"))
    assert ok and result["reused"] == 2 and result["encoded"] == 0, result
    assert _files(out) == {k: v for k, v in before.items() if k.endswith(".pt")}
