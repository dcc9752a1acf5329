"""Temporal and resize policies on real clips of known frame counts and fps: the indices each policy chooses,
the frames it decodes (against a full decode), short clips under both choices, windows:K as many samples per
clip (ids, counts, resume, reconciliation, decode-and-verify), and each resize policy against a straight-line
reference."""

from __future__ import annotations

import io
import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flows.terminal_run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.cache import ledger
from infra.config import CacheSpec
from infra.errors import ConfigError, InputError
from infra.media.resize import cover_crop_pixels, resize_pixels
from infra.media.temporal import choose_windows, effective_fps, make_policy
from infra.media.video import probe_frames
from infra.preprocess.prepare import prepare_video
from tests.conftest import config, make_shards, sample, tree_hashes

#: The test media (frames, fps), as the container says and decoding confirms.
KNOWN = {"bikes": (250, 25.0), "carphone": (120, 30000 / 1001), "sample_1080p": (23, 24000 / 1001)}


def _all_frames(video: bytes) -> np.ndarray:
    with av.open(io.BytesIO(video)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _spec(frames: int, temporal: str, **other) -> CacheSpec:
    fields = {"family": "wan22", "model_identity": {}, "format": "pt", "frames": frames, "height": 48, "width": 80}
    fields |= {"dtype": "fp32", "text_max_length": 8, "text_padding": "raw", "latent_norm": "x"}
    return CacheSpec(**fields, temporal=temporal, **other)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_the_test_media_has_the_frame_counts_and_rates_the_tests_assume(clips, name):
    frames, fps = probe_frames(clips[name])
    assert (frames, fps) == pytest.approx(KNOWN[name]) and len(_all_frames(clips[name])) == frames


@pytest.mark.parametrize(
    ("temporal", "frames", "expected"),
    [
        ("span", 5, [0, 62, 124, 187, 249]),  # np.linspace(0, 249, 5).round()
        ("head", 4, [0, 1, 2, 3]),
        ("fps:10", 5, [0, 2, 5, 8, 10]),  # round(i * 25 / 10): 0, 2.5→2, 5, 7.5→8, 10 (half to even)
        ("stride:3", 4, [0, 3, 6, 9]),
    ],
)
def test_each_policy_chooses_its_indices_and_decodes_exactly_those_frames(clips, temporal, frames, expected):
    total, fps = probe_frames(clips["bikes"])
    assert list(choose_windows(make_policy(temporal), total, fps, frames)[0].indices) == expected
    prepared = prepare_video(clips["bikes"], _spec(frames, make_policy(temporal).spec_value))
    assert list(prepared.clip.indices) == expected
    frames_expected = _all_frames(clips["bikes"])[expected]
    assert torch.equal(prepared.pixels, resize_pixels(frames_expected, 48, 80, "stretch"))
    if temporal != "head":  # made into pixels as they were decoded: no source-resolution frame is kept
        assert prepared.clip.frames.size == 0 and prepared.clip.pixels is None  # the pixels are held once


def test_stride_start_fps_rounding_and_effective_fps(clips):
    total, fps = probe_frames(clips["carphone"])  # 29.97 fps
    assert list(choose_windows(make_policy("stride:2", start=7), total, fps, 3)[0].indices) == [7, 9, 11]
    at_24 = choose_windows(make_policy("fps:24"), total, fps, 6)[0].indices
    assert list(at_24) == [round(i * fps / 24) for i in range(6)] == [0, 1, 2, 4, 5, 6]
    assert effective_fps((0, 2, 4), 25.0) == 12.5 and effective_fps((0, 62, 124, 187, 249), 25.0) == 25 * 4 / 249
    with pytest.raises(ConfigError, match="--start"):
        make_policy("span", start=3)
    with pytest.raises(ConfigError, match="window-step"):
        make_policy("stride:2", window_step=4)


@pytest.mark.parametrize("temporal", ["head", "stride:2", "windows:2", "span", "fps:12"])
def test_a_clip_too_short_for_the_policy_is_skipped_or_repeated(clips, temporal):
    deer = clips["sample_1080p"]  # 23 frames at 23.976 fps; 24 asked (stride:2, windows:2 and fps:12 reach frame 46)
    policy = make_policy(temporal)
    for short in ("skip", "repeat"):
        spec = _spec(24, policy.spec_value, short_clips=short)
        if short == "skip":
            with pytest.raises(InputError, match="23 frame") as caught:
                prepare_video(deer, spec)
            assert caught.value.reason == "clip_too_short"
        else:
            prepared = prepare_video(deer, spec)
            assert len(prepared.clip.indices) == 24 and max(prepared.clip.indices) == 22
            assert prepared.pixels.shape[2] == 24
    assert policy.short == ("repeat" if temporal in ("span", "fps:12") else "skip")  # the per-policy defaults


def test_windows_chooses_every_non_overlapping_window_or_every_step(clips):
    total, fps = probe_frames(clips["carphone"])  # 120 frames; 5 frames at stride 4 span 17
    windows = choose_windows(make_policy("windows:4"), total, fps, 5)
    assert [w.first for w in windows] == list(range(0, 120 - 16, 17)) and len(windows) == 7
    assert list(windows[1].indices) == [17, 21, 25, 29, 33]
    stepped = choose_windows(make_policy("windows:4", window_step=40, start=3), total, fps, 5)
    assert [w.first for w in stepped] == [3, 43, 83]


def test_windows_build_one_sample_per_window_and_resume_reconcile_and_decode_them(tmp_path, tiny_model, clips):
    src = make_shards(
        tmp_path / "src",
        {"G-11_part-00000": [sample(0, 0, clips["carphone"], b"a call"), sample(0, 1, clips["sample_1080p"], b"deer")]},
    )
    cfg = config(src, tiny_model, tmp_path / "out", frames=5, temporal="windows:4")
    ok, result = run_build(cfg)
    rows = next(iter(ledger.read_all(tmp_path / "out").values()))
    ids = sorted(r.id for r in rows.values())
    call = [f"handle_object_reappearance_00000000@{f}" for f in range(0, 104, 17)]
    assert ok and result["done"] == 8 and ids == sorted([*call, "handle_object_reappearance_00000001@0"]), ids
    row = rows[next(k for k in rows if k.endswith("00000000@17"))]
    assert row.extra["windows"] == 7 and row.path.endswith("handle_object_reappearance_00000000@17.pt")
    assert row.extra["sampling"] == {
        "source_fps": pytest.approx(29.97003),
        "fps": pytest.approx(29.97003 / 4),
        "indices": [17, 21, 25, 29, 33],
    }
    reconciliation = json.loads(Path(result["run_report"]).read_text())["reconciliation"]
    assert result["reconciled"] and reconciliation["expected"] == reconciliation["produced"] == 8
    before = tree_hashes(tmp_path / "out")
    ok, again = run_build(cfg)
    assert ok and again["encoded"] == 0 and again["reused"] == 8 and tree_hashes(tmp_path / "out") == before
    report = decode_and_verify(tmp_path / "out", n=2, device="cpu")
    assert not report.problems and len(report.rows) == 2 and all(r.frames == 5 for r in report.rows)


def test_resize_policies_match_straight_line_references():
    frames = np.random.default_rng(0).integers(0, 256, (3, 90, 160, 3), dtype=np.uint8)
    x = torch.from_numpy(frames).float()
    # stretch: the Wan2.2 recipe, /127.5 - 1 then bilinear without corner alignment
    want = F.interpolate((x / 127.5 - 1).permute(0, 3, 1, 2), size=(48, 64), mode="bilinear", align_corners=False)
    assert torch.equal(resize_pixels(frames, 48, 64, "stretch")[0], want.permute(1, 0, 2, 3))
    # cover-crop(-aa): 160x90 to cover 64x64 is 113x64 (width truncated), then the centre 64 columns from 24
    for policy, mode in (("cover-crop", "bicubic"), ("cover-crop-aa", "bilinear")):
        scaled = F.interpolate((x / 255).permute(0, 3, 1, 2), size=(64, 113), mode=mode, antialias=True)
        want = (scaled[:, :, :, 24:88].clamp(0, 1) - 0.5) / 0.5
        assert torch.equal(resize_pixels(frames, 64, 64, policy)[0], want.permute(1, 0, 2, 3)), policy
    assert torch.equal(resize_pixels(frames, 64, 64, "cover-crop"), cover_crop_pixels(frames, 64, 64))
    assert not torch.equal(resize_pixels(frames, 64, 64, "cover-crop"), resize_pixels(frames, 64, 64, "cover-crop-aa"))
