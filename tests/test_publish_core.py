"""The store-independent half of the upload: the manifest from the ledgers, the gate from the run report,
the per-file decision against a remote listing, and the remote check. Stores have their own tests."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from flows.terminal_run import run_build
from infra.config import UploadConfig
from infra.publish.base import RemoteFile, parse_target
from infra.publish.check import check_remote
from infra.publish.diff import plan_upload
from infra.publish.manifest import build_manifest, gate_problems
from infra.report_files import write_new
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip

TARGET = parse_target("s3://bucket/caches/wan")
UPLOAD = UploadConfig(to=TARGET.url)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_model, clips) -> Path:
    root = tmp_path_factory.mktemp("publish-core")
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(
        root / "src",
        {"a": [sample(0, 0, video, b"one"), sample(1, 0, video, b"two")], "b": [sample(1, 1, b"junk", b"bad")]},
    )
    ok, result = run_build(config(src, tiny_model, root / "cache"))
    assert ok and result["done"] == 2 and result["skipped"] == 1, result
    return root / "cache"


def _copy(cache: Path, tmp_path: Path) -> Path:
    shutil.copytree(cache, tmp_path / "out")
    return tmp_path / "out"


def _listing(manifest) -> dict[str, RemoteFile]:
    return {f.path: RemoteFile(f.path, f.size, sha256=f.sha256, etag=f"e-{f.sha256[:8]}") for f in manifest.files}


def test_manifest_comes_from_the_ledgers_in_send_order(cache):
    manifest = build_manifest(cache, UPLOAD, TARGET)
    roles = [f.role for f in manifest.files]
    assert roles == sorted(roles, key=["data", "report", "card", "ledger", "manifest"].index)
    assert manifest.files[-1].path == "cache.json" and manifest.files[-1].role == "manifest"
    data = {f.path for f in manifest.by_role("data")}
    assert len(data) == 2 and all(p.endswith(".pt") for p in data)
    assert {f.path for f in manifest.by_role("ledger")} == {"ledger/a.jsonl", "ledger/b.jsonl"}
    assert [f.path for f in manifest.by_role("card")] == ["README.md"]
    assert any(f.path.startswith("reports/run-") for f in manifest.by_role("report"))
    assert not any(".lock" in f.path for f in manifest.files)


def test_include_and_exclude_narrow_data_and_reports_only(cache):
    group = sorted({f.path.split("/")[0] for f in build_manifest(cache, UPLOAD, TARGET).by_role("data")})[0]
    narrowed = build_manifest(cache, UPLOAD.model_copy(update={"include": [f"{group}/*"]}), TARGET)
    assert [f.path.split("/")[0] for f in narrowed.by_role("data")] == [group]
    assert not narrowed.by_role("report") and narrowed.by_role("ledger") and narrowed.by_role("manifest")
    assert narrowed.excluded > 0 and len(narrowed.all_paths) > len(narrowed.files)
    no_reports = build_manifest(cache, UPLOAD.model_copy(update={"exclude": ["reports/"]}), TARGET)
    assert not no_reports.by_role("report") and len(no_reports.by_role("data")) == 2


def test_a_damaged_or_unfinished_cache_is_not_published(cache, tmp_path):
    out = _copy(cache, tmp_path)
    sample_file = out / build_manifest(out, UPLOAD, TARGET).by_role("data")[0].path
    sample_file.write_bytes(sample_file.read_bytes() + b"x")
    with pytest.raises(RuntimeError, match=r"(?s)not whole.*ledger a says"):
        build_manifest(out, UPLOAD, TARGET)
    sample_file.unlink()
    (out / "ledger" / "b.journal.jsonl").write_text("")
    with pytest.raises(RuntimeError, match="not on disk") as info:
        build_manifest(out, UPLOAD, TARGET)
    assert "unsealed journal" in str(info.value)


def test_gate_reads_the_newest_run_report(cache, tmp_path):
    out = _copy(cache, tmp_path)
    fingerprint = build_manifest(out, UPLOAD, TARGET).fingerprint
    report = json.loads(max((out / "reports").glob("run-*.json")).read_text())
    assert report["reconciliation"]["ok"] is False and report["decisions"][0]["choice"] == "accept_loss"
    assert gate_problems(out, fingerprint) == []  # a loss accepted by a recorded decision passes

    def newer(**changes):
        write_new(
            out / "reports", "run", {".json": json.dumps({**report, **changes}).encode()}, stamp="29991231T000000Z"
        )

    newer(decisions=[])
    assert "nobody accepted the loss" in gate_problems(out, fingerprint)[0]
    failed_decode = {
        "out": "o",
        "model": "m",
        "source": "s",
        "report_dir": "d",
        "min_psnr": 30.0,
        "rows": [],
        "problems": [],
        "mean_psnr": None,
        "mean_ssim": None,
        "ok": False,
        "strip_paths": [],
    }
    newer(decode=failed_decode)
    assert any("decode gate failed" in p for p in gate_problems(out, fingerprint))
    newer(decode={"ok": False})  # a section missing its keys is not read as anything
    assert any("not a run report of this version" in p for p in gate_problems(out, fingerprint))
    newer(reconciliation=None)
    assert any("no reconciliation" in p for p in gate_problems(out, fingerprint))
    assert "build (or resume)" in gate_problems(tmp_path / "nothing", fingerprint)[0]


def test_remote_decisions_unchanged_update_conflict_extra(cache):
    manifest = build_manifest(cache, UPLOAD, TARGET)
    listing = _listing(manifest)
    plan = plan_upload(manifest, listing, manifest.fingerprint, TARGET)
    assert not plan.send and not plan.conflicts and len(plan.unchanged) == len(manifest.files)

    data, ledger_file = manifest.by_role("data")[0], manifest.by_role("ledger")[0]
    changed = dict(listing)
    changed[data.path] = replace(listing[data.path], sha256="0" * 64)  # another encoder's latents, same size
    changed[ledger_file.path] = replace(listing[ledger_file.path], size=1)  # our older ledger
    changed["other/stray.pt"] = RemoteFile("other/stray.pt", 3, sha256="1" * 64)
    del changed["cache.json"]
    plan = plan_upload(manifest, changed, manifest.fingerprint, TARGET)
    assert [f.path for f in plan.send] == ["cache.json"]
    assert [o.path for o, _ in plan.conflicts] == [data.path]  # data is never updated in place
    assert [o.path for o, _ in plan.update] == [ledger_file.path]
    assert plan.extra == ["other/stray.pt"]
    token = plan.token

    other_cache = plan_upload(manifest, changed, "f" * 64, TARGET)  # the remote holds another cache
    assert {o.path for o, _ in other_cache.conflicts} == {data.path, ledger_file.path}
    moved = dict(changed)
    moved[data.path] = replace(changed[data.path], etag="e-moved")  # the remote file changed again
    assert plan_upload(manifest, moved, manifest.fingerprint, TARGET).token != token
    assert "--approve-replace" in plan.conflicts_markdown() and data.path in plan.conflicts_markdown()


def test_remote_check_names_every_kind_of_mismatch(cache):
    manifest = build_manifest(cache, UPLOAD, TARGET)
    listing = _listing(manifest)
    assert check_remote(manifest, listing, TARGET.url).ok
    a, b, c, d = manifest.files[:4]
    listing[a.path] = replace(listing[a.path], sha256="0" * 64)
    listing[b.path] = replace(listing[b.path], size=listing[b.path].size + 1)
    listing[c.path] = replace(listing[c.path], sha256=None)  # an object someone else wrote: no hash to compare
    del listing[d.path]
    listing["x/extra.pt"] = RemoteFile("x/extra.pt", 1)
    listing["reports/run-20000101T000000Z.json"] = RemoteFile("reports/run-20000101T000000Z.json", 1)
    check = check_remote(manifest, listing, TARGET.url)
    assert not check.ok
    assert (check.hash_mismatch, check.size_mismatch, check.unverifiable, check.missing) == (
        [a.path],
        [b.path],
        [c.path],
        [d.path],
    )
    assert check.extra == ["x/extra.pt"]  # older reports on the remote are tolerated
    assert check.verified == len(manifest.files) - 4 and "MISMATCH" in check.text()


def test_targets_parse_or_say_what_is_accepted():
    hub = parse_target("hf://datasets/org/name@dev/caches/wan")
    assert (hub.repo_id, hub.revision, hub.prefix, hub.key("cache.json")) == (
        "org/name",
        "dev",
        "caches/wan",
        "caches/wan/cache.json",
    )
    s3 = parse_target("s3://bucket")
    assert (s3.bucket, s3.prefix, s3.key("a/b.pt"), s3.relative("a/b.pt")) == ("bucket", "", "a/b.pt", "a/b.pt")
    assert TARGET.relative("caches/wan/x") == "x" and TARGET.relative("caches/other/x") is None
    for bad in ("gs://bucket/x", "hf://models/org/name", "s3://bucket/a/../b", "hf://datasets/noslash"):
        with pytest.raises(ValueError, match=r"hf://datasets/ORG/NAME|may not contain"):
            parse_target(bad)
