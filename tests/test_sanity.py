"""The one-sample sanity gate and the disk check: real clips, the tiny real-architecture model."""

from __future__ import annotations

import logging
import mmap
import shutil
import time

import pytest
import torch

from flows.terminal_run import run_build
from infra.demo.testmedia import real_t5_tokenizer_dir
from infra.errors import ModelLoadError
from infra.formats.pt import PtFormat
from infra.gates.disk import check_disk
from infra.plan import make_plan
from infra.preprocess.one_sample import MARKER, SanityDirError, peak_memory, sanity_dir
from infra.report_files import human_bytes
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.steps import sanity

logger = logging.getLogger(__name__)

CLIP_NAMES = ("bikes", "carphone", "bigbuckbunny", "sample_1080p", "bikes", "carphone")


@pytest.fixture(scope="module")
def short_clips(clips: dict[str, bytes]) -> list[bytes]:
    """Six real short clips (20 frames, 160 px wide)."""
    return [cut_clip(clips[name], 20, width=160) for name in CLIP_NAMES]


@pytest.fixture
def source(tmp_path, short_clips):
    """One shard of six good samples in two groups."""
    samples = [sample(i % 2, i, video, f"clip {i}: a short real video".encode()) for i, video in enumerate(short_clips)]
    return make_shards(tmp_path / "src", {"part-00000": samples})


def test_sanity_writes_only_into_the_sanity_dir(tmp_path, tiny_model, source):
    out = tmp_path / "cache" / "wan22"
    (tmp_path / "cache").mkdir()
    plan = make_plan(config(source, tiny_model, out))
    for _ in range(2):  # a second run replaces the sample inside its own marked dir
        report = sanity(plan)
        assert report.ok, report.problems
    assert not out.exists()
    assert sanity_dir(out) == tmp_path / "cache" / "wan22.sanity"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["wan22.sanity"]
    written = sorted(str(p.relative_to(sanity_dir(out))) for p in sanity_dir(out).rglob("*") if p.is_file())
    assert written == [MARKER, f"{report.sample_group}/{report.sample_id}.pt"]
    assert (report.latent_shape, report.text_shape) == (list(plan.job.latent_shape), list(plan.job.text_shape))
    assert (report.latent_dtype, report.text_dtype) == ("torch.bfloat16", "torch.bfloat16")
    assert report.finite and report.round_trip and report.device == "cpu"
    assert report.sample_id.endswith("_00000000") and report.skipped_before == []
    assert report.total_samples == 6 and report.projected_bytes == 6 * report.bytes
    assert report.seconds > 0 and report.peak_memory_bytes >= 0
    assert report.text().splitlines()[0].split() == ["sanity", "ok"] and "## Sanity: ok" in report.markdown()
    assert report.to_dict()["latent_shape"] == list(plan.job.latent_shape)


def test_a_bad_first_sample_is_skipped_and_the_next_one_used(tmp_path, tiny_model, short_clips):
    samples = [
        sample(0, 0, short_clips[0], None),
        sample(0, 1, None, b"no video"),
        sample(1, 2, short_clips[1], b"a good one"),
        sample(1, 3, short_clips[2], b"another good one"),
    ]
    src = make_shards(tmp_path / "src", {"mixed": samples})
    report = sanity(make_plan(config(src, tiny_model, tmp_path / "out")))
    assert report.ok, report.problems
    assert report.sample_id.endswith("_00000002")
    assert [reason for _, reason in report.skipped_before] == ["missing_prompt", "missing_video"]
    assert all(key.endswith(("_00000000", "_00000001")) for key, _ in report.skipped_before)
    assert report.total_samples == 4 and "missing_prompt" in report.markdown()


def test_an_all_bad_source_is_not_ok(tmp_path, tiny_model, short_clips):
    samples = [sample(0, 0, short_clips[0], None), sample(0, 1, None, b"x"), sample(0, 2, short_clips[0], b" \n")]
    src = make_shards(tmp_path / "src", {"bad": samples})
    out = tmp_path / "out"
    report = sanity(make_plan(config(src, tiny_model, out)))
    assert not report.ok
    assert report.problems == ["no usable sample in the plan (3 skipped)"]
    assert [r for _, r in report.skipped_before] == ["missing_prompt", "missing_video", "empty_prompt"]
    assert not out.exists() and "FAILED" in report.text()


@pytest.mark.parametrize(("frames", "height", "width"), [(17, 48, 80), (21, 64, 96)])
def test_the_sanity_sample_has_the_planned_geometry(tmp_path, tiny_model, short_clips, frames, height, width):
    src = make_shards(tmp_path / "src", {"one": [sample(0, 0, short_clips[3], b"a train of thought")]})
    plan = make_plan(config(src, tiny_model, tmp_path / "out", frames=frames, height=height, width=width))
    assert plan.job.latent_shape == (48, 1 + (frames - 1) // 4, height // 16, width // 16)
    report = sanity(plan)
    assert report.ok, report.problems
    record = PtFormat().read(report.path)
    assert tuple(record["x0"].shape) == plan.job.latent_shape and record["x0"].dtype == torch.bfloat16
    assert tuple(record["text_embeds"].shape) == plan.job.text_shape == (512, 64)
    assert record["latent_shape"] == list(plan.job.latent_shape) == report.latent_shape


def test_a_failed_check_is_reported_not_raised(tmp_path, tiny_model, source, monkeypatch):
    plan = make_plan(config(source, tiny_model, tmp_path / "out"))
    wrong = plan.model_copy(update={"job": plan.job.model_copy(update={"latent_shape": (48, 99, 3, 5)})})
    report = sanity(wrong)
    assert not report.ok and report.round_trip
    assert report.problems == [f"x0 shape {list(plan.job.latent_shape)}, planned [48, 99, 3, 5]"]

    real_read = PtFormat.read

    def flipped(self, path):
        record = real_read(self, path)
        record["x0"] = record["x0"].clone()
        record["x0"].view(-1)[0] += 1
        return record

    monkeypatch.setattr(PtFormat, "read", flipped)
    report = sanity(plan)
    assert not report.ok and not report.round_trip
    assert report.problems == ["round trip through the pt reader is not bit-identical"]


def test_an_encode_error_is_reported_not_raised(tmp_path, tiny_model, source):
    mismatched = tmp_path / "model"
    shutil.copytree(tiny_model, mismatched)
    shutil.rmtree(mismatched / "tokenizer")  # a 32,100-piece tokenizer with a 2,048-row embedding table
    shutil.copytree(real_t5_tokenizer_dir(), mismatched / "tokenizer")
    report = sanity(make_plan(config(source, mismatched, tmp_path / "out")))
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith(f"encode_error on {report.sample_key}: IndexError")
    assert report.sample_key.endswith("_00000000") and not (tmp_path / "out").exists()


def test_a_sanity_dir_without_the_marker_is_refused(tmp_path, tiny_model, source):
    out = tmp_path / "out"
    foreign = tmp_path / "out.sanity"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's scratch")
    before = tree_hashes(tmp_path / "out.sanity")
    with pytest.raises(SanityDirError, match=r"out\.sanity exists but has no \.latentforge-sanity file"):
        sanity(make_plan(config(source, tiny_model, out)))
    assert tree_hashes(foreign) == before and not out.exists()


def test_a_model_that_cannot_load_raises(tmp_path, tiny_model, source):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot load wan22"):
        sanity(make_plan(config(source, broken, tmp_path / "out")))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.sanity").exists()


def test_the_projection_is_the_sample_times_the_plan_and_its_bytes_match_the_build(tmp_path, tiny_model, source):
    """How close the time projection comes to a real run is a benchmark (bench/sanity_bench.py: timing belongs
    on a quiet machine); here the arithmetic, and the bytes, which do not depend on the machine's load."""
    out = tmp_path / "out"
    ok, summary = run_build(config(source, tiny_model, out))
    assert ok and summary["encoded"] == 6, summary
    report = sanity(make_plan(config(source, tiny_model, tmp_path / "fresh")))
    assert report.ok and report.total_samples == 6
    assert report.projected_seconds == round(report.seconds * 6, 3) and report.seconds > 0
    assert report.projected_bytes == report.bytes * 6
    assert 0.9 <= report.projected_bytes / summary["bytes"] <= 1.1


def test_the_builds_sanity_takes_the_first_sample_it_would_encode(tmp_path, tiny_model, source, monkeypatch):
    """On a resume the build's sanity tries a sample the build will encode (not one OUT already holds); on a
    finished cache there is none: the report says so, and no model is loaded (nor any media read)."""
    out = tmp_path / "out"
    ok, summary = run_build(config(source, tiny_model, out, limit=2))
    assert ok and summary["encoded"] == 2, summary
    plan = make_plan(config(source, tiny_model, out))
    assert sanity(plan).sample_id.endswith("_00000000")  # the standalone sanity: the plan's first sample
    resumed = sanity(plan, pending_only=True)
    assert resumed.ok and resumed.sample_id.endswith("_00000002") and not resumed.nothing_to_encode
    ok, summary = run_build(config(source, tiny_model, out))
    assert ok and summary["encoded"] == 4 and summary["sanity"]["sample_id"].endswith("_00000002"), summary

    def no_model(plan):
        raise AssertionError("a finished cache's sanity loads no model")

    monkeypatch.setattr("infra.preprocess.one_sample.load_encoder", no_model)
    finished = sanity(plan, pending_only=True)
    assert finished.ok and finished.nothing_to_encode and finished.sample_id is None
    assert "none to encode: all 6 planned samples are done" in finished.text()
    ok, summary = run_build(config(source, tiny_model, out))
    assert ok and summary["encoded"] == 0 and summary["sanity"]["nothing_to_encode"], summary


def test_a_resume_with_only_unusable_samples_left_passes_a_fresh_one_does_not(tmp_path, tiny_model, short_clips):
    """The samples a resume has left are the ones skipped before (a corrupt clip): the build skips them again, so
    the sanity passes, saying so; a fresh OUT whose every sample is unusable still fails."""
    good, other = short_clips[0], short_clips[1]
    samples = [sample(0, 0, good, b"good"), sample(0, 1, None, b"no video"), sample(1, 2, other, b"ok")]
    src = make_shards(tmp_path / "src", {"mixed": samples})
    out = tmp_path / "out"
    ok, summary = run_build(config(src, tiny_model, out))
    assert ok and (summary["encoded"], summary["skipped"]) == (2, 1), summary
    report = sanity(make_plan(config(src, tiny_model, out)), pending_only=True)
    assert report.ok and report.nothing_to_encode and [r for _, r in report.skipped_before] == ["missing_video"]
    assert "none usable left to encode" in report.text()
    bad = make_shards(tmp_path / "bad", {"bad": [sample(0, 0, None, b"no video")]})
    fresh = sanity(make_plan(config(bad, tiny_model, tmp_path / "fresh")), pending_only=True)
    assert not fresh.ok and fresh.problems == ["no usable sample in the plan (1 skipped)"]


def test_check_disk(tmp_path):
    out = tmp_path / "cache"
    (out / "g").mkdir(parents=True)
    (out / "g" / "a.pt").write_bytes(b"x" * 1234)
    short = check_disk(out, 10**18)
    assert not short.ok and short.current_cache_bytes == 1234
    assert short.needed_bytes == (10**18 - 1234) + -(-(10**18 - 1234) * 5 // 100)
    assert human_bytes(short.free_bytes) in short.message and "1.2 KB" in short.message
    assert "not enough disk" in short.message
    small = check_disk(out, 10_000)
    assert small.ok and small.needed_bytes == -(-(10_000 - 1234) * 105 // 100)
    assert check_disk(out, 1000).needed_bytes == 0  # already on disk: a resume writes nothing more
    absent = check_disk(tmp_path / "not" / "yet" / "there", 4096)
    assert absent.ok and absent.current_cache_bytes == 0 and absent.free_bytes > 0


def test_peak_memory_sees_a_transient_allocation():
    """CPU: peak RSS growth sampled by a thread. (The CUDA branch reads torch.cuda's own peak counter;
    it has not run here: no GPU on this machine.)"""
    size = 64 * 2**20
    with peak_memory(torch.device("cpu")) as peak:
        block = mmap.mmap(-1, size)  # fresh anonymous pages: resident only once written
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        time.sleep(0.3)  # long enough for the sampler on a loaded 2-core machine
        block.close()
    assert 48 * 2**20 <= peak[0] < 1 << 31
