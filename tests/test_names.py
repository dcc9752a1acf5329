"""Names as bytes, real names and the identity of a sample's file, through real builds (tiny Wan2.2, real clips).

A name that is not UTF-8 (a folder file, a tar member) or a caption that is not (a JSON lone surrogate) is that
sample's skipped row, written safely; real names (spaces, ß, NFC and NFD, brackets, a unicode folder) are encoded
under safe output names, their original kept in the ledger row and the file; names that differ only by case or
Unicode form are refused at the plan (the first kept); a file copied to another sample's path is not adopted.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.plan import make_plan
from infra.sources import is_safe_name
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.test_sources import write_members

CLIP_FRAMES = 12
NFC_CAFE, NFD_CAFE = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
#: The folder's files (as bytes: one is not UTF-8) → (the row's key, status, reason).
FOLDER: dict[bytes, tuple[str, str, str | None]] = {
    b"a.mp4": ("a.mp4", "done", None),
    b"c\xff.mp4": ("c\\xff.mp4", "skipped", "bad_layout"),
    b"sample 1080p.mp4": ("sample 1080p.mp4", "done", None),
    "Straße.mp4".encode(): ("Straße.mp4", "done", None),
    b"[draft] (1).mp4": ("[draft] (1).mp4", "done", None),
    b"Clip.mp4": ("Clip.mp4", "done", None),
    b"clip.mp4": ("clip.mp4", "skipped", "name_collision"),  # Clip.mp4 sorts first: kept
    f"{NFD_CAFE}.mp4".encode(): (f"{NFD_CAFE}.mp4", "done", None),  # NFD sorts before NFC: kept
    f"{NFC_CAFE}.mp4".encode(): (f"{NFC_CAFE}.mp4", "skipped", "name_collision"),
    "Ordner ä/x.mp4".encode(): ("Ordner ä/x.mp4", "done", None),
}
runner = CliRunner()


def _short8(name: str) -> str:
    return hashlib.sha256(unicodedata.normalize("NFC", name).encode()).hexdigest()[:8]


def _write(root: Path, name: bytes, data: bytes, caption: bytes) -> None:
    """`name` (bytes, verbatim: os hands undecodable bytes over as surrogates) under root, its caption beside it."""
    path = root / os.fsdecode(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.with_suffix(".txt").write_bytes(caption)


def _rows(out: Path) -> dict[str, ledger.LedgerRow]:
    """Every row of OUT by key, after checking that each ledger file is UTF-8 and one JSON object a line."""
    for path in (out / ledger.LEDGER_DIR).glob("*.jsonl"):
        for line in path.read_bytes().decode("utf-8").split("\n")[:-1]:
            assert isinstance(json.loads(line), dict)
    return {key: row for rows in ledger.read_all(out).values() for key, row in rows.items()}


@pytest.fixture(scope="module")
def folder_build(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("names")
    clip = cut_clip(clips["bikes"], CLIP_FRAMES, width=160)
    for name in FOLDER:
        _write(root / "src", name, clip, b"a clip of " + name)
    cfg = config(root / "src", tiny_model, root / "out", source=f"folder:{root / 'src'}")
    ok, result = run_build(cfg)
    assert ok, result
    return {"out": root / "out", "config": cfg, "result": result}


def test_a_name_not_utf8_is_one_skipped_row_and_real_names_are_encoded(folder_build):
    """Before: the ``c\\xff.mp4`` row crashed the journal (the shard and every resume with it); ``sample 1080p``,
    ``Straße`` ... were bad_layout. Now every file has exactly one row, the real names done under safe names."""
    out, rows = folder_build["out"], _rows(folder_build["out"])
    assert {k: (r.status, r.reason) for k, r in rows.items()} == {k: (s, r) for k, s, r in FOLDER.values()}
    bad = rows["c\\xff.mp4"]
    assert bad.id == "c\\xff.mp4" and "c\\xff.mp4" in bad.detail and bad.path is None
    done = {k: r for k, r in rows.items() if r.status == "done"}
    paths = [r.path for r in done.values()]
    assert len(set(paths)) == len(paths) and all(all(is_safe_name(p) for p in Path(r).parts) for r in paths)
    assert done["a.mp4"].path == "a.pt" and done["Clip.mp4"].path == "Clip.pt"  # safe names: their paths as before
    assert done["sample 1080p.mp4"].path == f"sample_1080p-{_short8('sample 1080p')}.pt"
    assert done["Straße.mp4"].path == f"Strasse-{_short8('Straße')}.pt"
    assert done[f"{NFD_CAFE}.mp4"].path == f"cafe-{_short8(NFC_CAFE)}.pt"  # the NFC and NFD spellings: one name
    assert done["Ordner ä/x.mp4"].path == f"Ordner_a-{_short8('Ordner ä')}/x.pt"
    for key, row in done.items():  # the original name, in the row and in the file
        record = torch.load(out / row.path, weights_only=True)
        assert (row.id, record["id"], record["group"]) == (key, key, row.group)
    assert done["Ordner ä/x.mp4"].group == "Ordner ä"
    assert "'Clip.mp4'" in rows["clip.mp4"].detail and f"'{NFD_CAFE}.mp4'" in rows[f"{NFC_CAFE}.mp4"].detail


def _facts(out: Path) -> dict[str, tuple[Any, ...]]:
    return {k: (r.status, r.reason, r.detail, r.path, r.sha256) for k, r in _rows(out).items()}


def test_the_same_build_again_resumes_to_the_same_bytes(folder_build):
    """Before: every resume crashed at the same row. Skipped rows are visited again (same facts)."""
    out = folder_build["out"]
    before, facts = tree_hashes(out), _facts(out)
    ok, result = run_build(folder_build["config"])
    assert ok, result
    assert (result["encoded"], result["reused"]) == (0, 7) and _facts(out) == facts
    after = tree_hashes(out)
    assert {k: v for k, v in after.items() if not k.startswith("ledger/")} == {
        k: v for k, v in before.items() if not k.startswith("ledger/")
    }


def test_verify_hashes_every_file_of_the_real_names_cache(folder_build):
    verified = runner.invoke(app, ["verify", str(folder_build["out"])])
    assert verified.exit_code == 0, verified.output
    assert "COMPATIBLE" in verified.output and "7 sample(s) done" in verified.output


def test_a_tar_member_not_utf8_and_a_caption_not_utf8_are_skipped_rows(tmp_path, tiny_model, clips):
    """Before: the tar member's row crashed its shard for good; the jsonl caption failed the plan."""
    clip = cut_clip(clips["carphone"], CLIP_FRAMES)
    good = sample(0, 1, clip, b"a good clip")
    src = make_shards(tmp_path / "vbvr", {"part-0": [good]})
    write_members(src / "part-1.tar", [("G\udcff/t_task/t_00000001/ground_truth.mp4", clip)])
    ok, result = run_build(config(src, tiny_model, tmp_path / "out-vbvr"))
    assert ok and result["done"] == 1, result
    (bad,) = [r for r in _rows(tmp_path / "out-vbvr").values() if r.status != "done"]
    assert (bad.key, bad.reason) == ("G\\xff/t_task/t_00000001", "bad_layout") and "G\\xff" in bad.detail

    (tmp_path / "meta").mkdir()
    for name in ("a b.mp4", "x.mp4"):
        (tmp_path / "meta" / name).write_bytes(clip)
    rows = [{"video": "a b.mp4", "caption": "fine"}, {"video": "x.mp4", "caption": "\udcff"}]
    (tmp_path / "meta" / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = config(tmp_path, tiny_model, tmp_path / "out-meta", source=f"meta:{tmp_path / 'meta' / 'd.jsonl'}")
    ok, result = run_build(meta)
    assert ok and result["done"] == 1, result
    found = _rows(tmp_path / "out-meta")
    assert (found["x.mp4"].status, found["x.mp4"].reason) == ("skipped", "prompt_not_utf8")
    assert found["a b.mp4"].path == f"a_b-{_short8('a b')}.pt"


def test_a_file_copied_to_another_samples_path_is_not_adopted(tmp_path, tiny_model, clips):
    """Before: B's path holding a copy of A's .pt (no row for B yet) was recorded as B, done, adopted."""
    videos = [cut_clip(clips["bikes"], CLIP_FRAMES, width=160), cut_clip(clips["carphone"], CLIP_FRAMES)]
    samples = [sample(0, i, v, f"clip {i}".encode()) for i, v in enumerate(videos)]
    src = make_shards(tmp_path / "src", {"part-0": samples})
    cfg = config(src, tiny_model, tmp_path / "out", limit=1)
    ok, result = run_build(cfg)
    assert ok and result["done"] == 1, result
    (a,) = _rows(tmp_path / "out").values()
    b_path = tmp_path / "out" / a.path.replace("_00000000.pt", "_00000001.pt")
    b_path.write_bytes((tmp_path / "out" / a.path).read_bytes())
    ok, result = run_build(cfg.with_values(limit=None))  # a file no row owns where a trainer loads it: a stop
    assert not ok and "no ledger row owns" in str(result), result
    ok, result = run_build(cfg.with_values(limit=None, on_conflict="reuse"))  # kept: still never adopted as B
    assert ok, result
    b = next(r for r in _rows(tmp_path / "out").values() if r.key != a.key)
    assert (b.status, b.reason, b.path) == ("failed", "output_exists", b_path.relative_to(tmp_path / "out").as_posix())
    assert f"id {a.id!r}" in b.detail and f"id {b.id!r}" in b.detail
    assert b_path.read_bytes() == (tmp_path / "out" / a.path).read_bytes()  # refused, never overwritten


def test_groups_that_differ_only_by_case_are_refused_at_the_plan(tmp_path, tiny_model):
    """Two VBVR generators ``G-1`` and ``g-1`` with the same sample id: one file on a case-insensitive disk, so the
    later is refused (name_collision), not taken for a duplicate id nor given a file of its own."""
    members = [(f"{g}/t_task/t_00000001/prompt.txt", b"p") for g in ("G-1", "g-1")]
    write_members(tmp_path / "src" / "a.tar", members[:1])
    write_members(tmp_path / "src" / "b.tar", members[1:])
    first, second = make_plan(config(tmp_path / "src", tiny_model, tmp_path / "out")).shards
    assert (first.collisions, first.duplicates, second.duplicates) == ({}, {}, {})
    assert list(second.collisions) == ["g-1/t_task/t_00000001"]
    assert "'G-1/t_task/t_00000001' in shard a" in second.collisions["g-1/t_task/t_00000001"]  # the first, named
