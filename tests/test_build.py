"""The build flow end to end: bad inputs as ledger rows, resume, conflicts, dry run, selection."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import infra.preprocess.prepare
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.demo.testmedia import real_t5_tokenizer_dir
from infra.plan import make_plan
from infra.preprocess.shard import process_shard
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip

CLIP_FRAMES = 12


@pytest.fixture(scope="module")
def short_clips(clips: dict[str, bytes]) -> list[bytes]:
    """Four quick real clips (cut and downscaled) for flow-level tests."""
    return [
        cut_clip(clips["bikes"], CLIP_FRAMES, width=160),
        cut_clip(clips["carphone"], CLIP_FRAMES),
        cut_clip(clips["bigbuckbunny"], CLIP_FRAMES, width=160),
        cut_clip(clips["sample_1080p"], CLIP_FRAMES, width=160),
    ]


@pytest.fixture
def source(tmp_path, short_clips):
    """Two shards, two groups, four good samples each shard."""
    shard_a = [sample(0, i, v, f"clip {i} of group zero".encode()) for i, v in enumerate(short_clips)]
    shard_b = [sample(1, i, v, f"clip {i} of group one".encode()) for i, v in enumerate(short_clips)]
    return make_shards(tmp_path / "src", {"G-11_part-00000": shard_a, "O-21_part-00000": shard_b})


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_bad_inputs_become_ledger_rows_and_the_rest_finish(tmp_path, tiny_model, clips, short_clips):
    good = short_clips[0]
    cases = {
        "done": (good, b"A cyclist waits in traffic."),
        "missing_prompt": (good, None),
        "empty_prompt": (good, b"  \n\t"),
        "prompt_not_utf8": (good, b"caf\xe9 \xff"),
        "missing_video": (None, b"no video here"),
        "empty_video": (b"", b"an empty file"),
        "no_video_stream": (clips["audio_only"], b"only audio"),
        "video_decode_error": (clips["truncated_mkv"], b"a truncated matroska file"),
        "not_a_video": (_png(), b"a png named mp4"),
    }
    samples = [sample(0, i, video, prompt) for i, (video, prompt) in enumerate(cases.values())]
    src = make_shards(tmp_path / "src", {"hostile": samples})
    ok, result = run_build(config(src, tiny_model, tmp_path / "out"))
    assert ok, result
    assert result["done"] == 1 and result["skipped"] == len(cases) - 1 and result["failed"] == 0
    assert result["reasons"] == {reason: 1 for reason in cases if reason != "done"}
    rows = ledger.read_shard(tmp_path / "out", "hostile")
    by_index = {int(r.id.rsplit("_", 1)[1]): r for r in rows.values()}
    for index, reason in enumerate(cases):
        row = by_index[index]
        assert (row.status, row.reason or "done") == ("done" if reason == "done" else "skipped", reason)
        assert (row.detail is None) == (reason == "done")


def test_resume_decodes_nothing_already_done(tmp_path, tiny_model, source, monkeypatch):
    decoded: list[int] = []
    real = infra.preprocess.prepare.sample_frames
    monkeypatch.setattr(
        infra.preprocess.prepare, "sample_frames", lambda data, n, **kw: decoded.append(n) or real(data, n, **kw)
    )
    out = tmp_path / "out"
    sanity = 1  # a run with work to do first encodes one sample it will encode beside OUT, as the sanity check

    ok, first = run_build(config(source, tiny_model, out, limit=3))
    assert ok, first
    assert (first["done"], len(decoded)) == (3, sanity + 3)
    partial = tree_hashes(out)

    ok, second = run_build(config(source, tiny_model, out))
    assert ok, second
    assert (second["done"], second["reused"], second["encoded"]) == (8, 3, 5)
    assert len(decoded) == 2 * sanity + 3 + 5  # the 3 done samples are not decoded again: the 5 others are
    after = tree_hashes(out)
    assert all(after[k] == v for k, v in partial.items() if k.endswith(".pt")), "a done sample was rewritten"

    ok, third = run_build(config(source, tiny_model, out))
    assert ok and (third["reused"], third["encoded"]) == (8, 0)
    assert len(decoded) == 2 * sanity + 8  # a finished cache: no sanity sample either, nothing decoded
    assert third["sanity"]["nothing_to_encode"]


def test_same_inputs_same_bytes(tmp_path, tiny_model, source):
    ok1, _ = run_build(config(source, tiny_model, tmp_path / "a", workers=1))
    ok2, _ = run_build(config(source, tiny_model, tmp_path / "b", workers=2))
    assert ok1 and ok2
    a = {k: v for k, v in tree_hashes(tmp_path / "a").items() if k.endswith(".pt")}
    b = {k: v for k, v in tree_hashes(tmp_path / "b").items() if k.endswith(".pt")}
    assert a == b and len(a) == 8


def test_a_cache_with_another_spec_is_never_written_to(tmp_path, tiny_model, source):
    out = tmp_path / "out"
    ok, _ = run_build(config(source, tiny_model, out, limit=2))
    assert ok
    before = tree_hashes(out)
    ok, message = run_build(config(source, tiny_model, out, frames=FRAMES + 4))
    assert not ok
    assert "holds another cache" in message and "frames" in message and str(FRAMES + 4) in message
    assert tree_hashes(out) == before


def test_a_foreign_directory_is_left_untouched(tmp_path, tiny_model, source):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's files")
    ok, message = run_build(config(source, tiny_model, out))
    assert not ok and "foreign" in message.lower()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_dry_run_writes_nothing(tmp_path, tiny_model, source):
    out = tmp_path / "out"
    ok, result = run_build(config(source, tiny_model, out, dry_run=True))
    assert ok, result
    shapes = result["dry_run"]
    assert shapes["x0"] == [[48, 1 + (FRAMES - 1) // 4, HEIGHT // 16, WIDTH // 16], "torch.bfloat16"]
    assert shapes["text_embeds"] == [[512, 64], "torch.bfloat16"]
    assert not out.exists()


def test_limit_filter_and_per_shard_cap(tmp_path, tiny_model, source):
    ok, result = run_build(config(source, tiny_model, tmp_path / "a", shard_filter="O-21"))
    assert ok and result["samples"] == 4
    assert {p.name for p in (tmp_path / "a").iterdir() if p.is_dir()} == {
        "O-21_ball_trajectory_data-generator",
        "ledger",
        "reports",
    }
    ok, result = run_build(config(source, tiny_model, tmp_path / "b", max_samples_per_shard=1))
    assert ok and result["samples"] == 2
    ok, result = run_build(config(source, tiny_model, tmp_path / "c", limit=5, max_samples_per_shard=3))
    assert ok and result["samples"] == 5


def test_cache_json_and_sample_files(tmp_path, tiny_model, source):
    out = tmp_path / "out"
    ok, result = run_build(config(source, tiny_model, out, limit=1))
    assert ok
    meta = json.loads((out / "cache.json").read_text())
    assert meta["fingerprint"] == result["fingerprint"]
    assert set(meta["spec"]["model_identity"]) == {"vae", "text_encoder", "tokenizer"}
    assert (meta["spec"]["frames"], meta["spec"]["height"], meta["spec"]["width"]) == (FRAMES, HEIGHT, WIDTH)
    (path,) = out.rglob("*.pt")
    record = torch.load(path, weights_only=True)
    assert set(record) >= {"x0", "text_embeds", "prompt", "source_shape", "latent_shape", "seq_len", "fingerprint"}
    assert record["source_shape"] == [CLIP_FRAMES, 68, 160, 3]
    assert record["fingerprint"] == meta["fingerprint"]


def test_a_model_that_cannot_load_fails_the_run_not_each_sample(tmp_path, tiny_model, source):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    ok, message = run_build(config(source, broken, tmp_path / "out", limit=2))
    assert not ok
    assert "cannot load wan22" in message  # stopped by the sanity step, before any shard
    assert not list((tmp_path / "out").rglob("*.pt"))


def test_a_broken_encoder_is_stopped_by_sanity_and_by_the_shard_fail_fast(tmp_path, tiny_model, source):
    mismatched = tmp_path / "model"
    shutil.copytree(tiny_model, mismatched)
    shutil.rmtree(mismatched / "tokenizer")  # a 32,100-piece tokenizer with a 2,048-row embedding table
    shutil.copytree(real_t5_tokenizer_dir(), mismatched / "tokenizer")
    cfg = config(source, mismatched, tmp_path / "out", shard_filter="G-11")
    ok, message = run_build(cfg)
    assert not ok and "one-sample sanity failed" in message and "IndexError" in message
    assert not (tmp_path / "out").exists()

    plan = make_plan(cfg)  # the shard task on its own: its first three encodes fail, so it stops
    with pytest.raises(RuntimeError, match=r"the first 3 encodes of shard G-11_part-00000 failed.*IndexError"):
        process_shard(plan.job, plan.shards[0])
    rows = ledger.read_shard(tmp_path / "out", "G-11_part-00000")
    assert [r.reason for r in rows.values()] == ["encode_error"] * 3


class _Plant:
    """Unpickling this creates `marker`: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_never_runs_in_a_build(tmp_path, tiny_model, source):
    out = tmp_path / "out"
    ok, _ = run_build(config(source, tiny_model, out, limit=2))
    assert ok
    marker = tmp_path / "pwned"
    victim = sorted(out.rglob("*.pt"))[0]
    torch.save(_Plant(marker), victim)  # at a done sample's path
    stray = victim.with_name("zz_99999999.pt")
    torch.save(_Plant(marker), stray)  # and where no ledger row points
    before = tree_hashes(out)
    outcomes = {}
    for policy in ("abort", "reuse", "new_dir"):
        ok, result = run_build(config(source, tiny_model, out, on_conflict=policy))
        assert not marker.exists(), f"a pickle ran under on_conflict={policy}"
        assert tree_hashes(out) == before
        outcomes[policy] = ok if ok else "damaged" in result.lower()
    assert outcomes == {"abort": True, "reuse": True, "new_dir": True}  # refused twice (damaged), moved once
    assert (tmp_path / "out-v2" / "cache.json").exists()
