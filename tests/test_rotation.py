"""A clip whose display matrix turns it (a phone video, made here with PyAV's ``set_display_rotation``: a real H.264
mp4 carrying the matrix): by default its frames are what the format's consumer's own reader gives (PyAV's, as stored,
for the seed recipe's ``pt``; DiffSynth-Studio's LoadVideo through imageio's ``ffmpeg`` program, upright, for
``diffsynth``), every rotated clip is named in the build summary and the run report with the flag that changes it, and
``--rotate auto`` turns it upright by the matrix, as another cache (its own fingerprint)."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from flows.terminal_run import run_build
from infra.audit.run_report import latest_run_report
from infra.media.resize import resize_pixels
from infra.media.video import head_frames, upright_frame
from infra.plan import make_spec
from infra.preprocess.build_summary import rotation_line
from infra.preprocess.prepare import prepare_video
from tests import diffsynth_ref as ds
from tests.conftest import config, make_shards, sample
from tests.ffmpeg_ref import ffmpeg_exe
from tests.media_utils import cut_clip

FRAMES, STORED_W, STORED_H = 9, 80, 48
GEOMETRY = {"frames": FRAMES, "height": 48, "width": 80, "temporal": "head"}


def _picture(index: int) -> np.ndarray:
    """A frame that shows which way is up: a white block top left, a green bar along the bottom, a moving dot."""
    picture = np.full((STORED_H, STORED_W, 3), 60, np.uint8)
    picture[:12, :20] = 255
    picture[-6:, :, 1] = 220
    picture[20:26, 4 * index : 4 * index + 6] = (220, 40, 40)
    return picture


def rotated_clip(rotation: int) -> bytes:
    """FRAMES frames of STORED_W×STORED_H, H.264 in mp4, with a display matrix of `rotation` degrees (counter-clockwise:
    the phone was held upright, the sensor stored it on its side)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as dst:
        stream = dst.add_stream("libx264", rate=Fraction(25, 1), options={"crf": "12", "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = STORED_W, STORED_H, "yuv420p"
        stream.set_display_rotation(rotation)
        for i in range(FRAMES):
            for packet in stream.encode(av.VideoFrame.from_ndarray(_picture(i), format="rgb24")):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out.getvalue()


@pytest.fixture(scope="module")
def phone() -> bytes:
    return rotated_clip(-90)  # a phone clip held upright: stored landscape, shown portrait


@pytest.fixture(scope="module")
def source(phone, clips, tmp_path_factory) -> Path:
    plain = cut_clip(clips["carphone"], FRAMES)
    made = [sample(0, 0, phone, b"a phone held upright"), sample(0, 1, plain, b"a man in a car")]
    return make_shards(tmp_path_factory.mktemp("rotation-src"), {"shard-0": made})


def test_pyav_decodes_the_stored_frames_and_reads_the_matrix(phone):
    clip = head_frames(phone, FRAMES)
    assert clip.rotation == -90 and clip.frames.shape[1:3] == (STORED_H, STORED_W)
    upright = head_frames(phone, FRAMES, upright=True)
    assert upright.frames.shape[1:3] == (STORED_W, STORED_H)
    assert (upright.source_height, upright.source_width) == (STORED_W, STORED_H)
    assert np.array_equal(upright.frames, np.stack([np.rot90(f, k=3) for f in clip.frames]))


def test_a_rotated_clip_is_stored_by_default_and_named_with_the_flag_that_turns_it(source, tiny_model, tmp_path):
    cfg = config(source, tiny_model, tmp_path / "out", **GEOMETRY, resize="stretch")
    ok, result = run_build(cfg)
    assert ok and result["done"] == 2, result
    clip = "G-11_handle_object_reappearance_data-generator/handle_object_reappearance_00000000"
    assert result["rotated"] == {"clips": {clip: -90}, "rotate": "stored"}
    line = rotation_line(result["rotated"])
    assert "1 clip(s)" in line and "as stored" in line and "--rotate auto" in line and f"{clip} (-90°)" in line
    report = latest_run_report(tmp_path / "out")
    assert report is not None and report.rotated == {"rotate": "stored", "change": "--rotate auto", **result["rotated"]}
    assert report.spec["rotate"] == "stored"


def test_rotate_auto_turns_it_upright_as_another_cache(phone, source, tiny_model, tmp_path):
    stored = make_spec(config(source, tiny_model, tmp_path / "a", **GEOMETRY))[1]
    turned = make_spec(config(source, tiny_model, tmp_path / "b", **GEOMETRY, rotate="auto"))[1]
    assert (stored.rotate, turned.rotate) == ("stored", "auto") and stored.fingerprint() != turned.fingerprint()
    frames = head_frames(phone, FRAMES).frames
    upright = np.stack([upright_frame(f, -90) for f in frames])
    assert torch.equal(prepare_video(phone, turned).pixels, resize_pixels(upright, 48, 80, "stretch"))
    assert torch.equal(prepare_video(phone, stored).pixels, resize_pixels(frames, 48, 80, "stretch"))
    assert "--rotate stored" in rotation_line({"clips": {"g/a": -90}, "rotate": "auto"})


@pytest.mark.parametrize("rotation", [90, -90, 180])
def test_diffsynths_own_reader_gives_the_frames_its_format_encodes(rotation, clips, wan21_model, tmp_path):
    """DiffSynth-Studio's own LoadVideo + ImageCropAndResize (the diffsynth wheel, imageio, the ``ffmpeg`` program
    imageio-ffmpeg ships), its preprocess_video, against latentforge's diffsynth spec: upright by default, resized by
    its arithmetic, the same numbers (a rotated synthetic clip, and a real one it resizes)."""
    ffmpeg_exe()
    spec = make_spec(config(tmp_path, wan21_model, tmp_path / "out", recipe="diffsynth-wan", frames=9, height=48,
                            width=64))[1]  # fmt: skip
    assert spec.rotate == "auto"
    pipe = ds.diffsynth().wan_video.WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    for name, data in (("phone", rotated_clip(rotation)), ("bikes", cut_clip(clips["bikes"], 9))):
        path = tmp_path / f"{name}.mp4"
        path.write_bytes(data)
        crop = ds.diffsynth().operators.ImageCropAndResize(48, 64, None, 16, 16)
        frames = ds.diffsynth().operators.LoadVideo(9, 4, 1, frame_processor=crop)(str(path))
        assert all(isinstance(f, Image.Image) for f in frames) and len(frames) == 9
        theirs = pipe.preprocess_video(frames)
        assert torch.equal(prepare_video(data, spec).pixels, theirs), name
