"""The LTX-2 trainer's reference and mask roles, through the public interface, with the tiny LTX-2 model and real
clips: ``reference_video`` (and the legacy ``ref_media_path``) → ``reference_latents/`` for ``--mode
v2v-ic-lora``, ``video_mask`` → ``video_masks/`` for ``--mode video-inpaint``.

What each file must hold is read from the trainer's ``process_dataset.py`` / ``process_videos.py`` (Lightricks/LTX-2,
``packages/ltx-trainer/scripts``): a reference is encoded by ``compute_latents`` over the reference column with
buckets scaled by ``compute_scaled_resolution_buckets`` and frames picked by ``_compute_temporal_subsample_indices``
(frame 0, then every Nth), named by the main video, its ``fps`` the source's over N; a video mask by
``compute_video_masks`` (transcribed in `_trainer_video_mask` below). Each cache is then loaded by `precomputed`,
which follows ``PrecomputedDataset``'s rules, with the data sources the trainer's ``FlexibleStrategyConfig``
asks for in that mode.
"""

from __future__ import annotations

import io
import json
import os
import wave
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from pydantic import ValidationError
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.demo.testmedia import real_clip
from infra.errors import ConfigError, SourceError
from infra.formats.consumers import latent_encoder
from infra.media.masks import video_mask
from infra.media.resize import resize_pixels
from infra.models import get_family
from infra.plan import make_plan, make_spec
from infra.preprocess.encode import load_encoder
from infra.sources import open_source
from tests.conftest import config, tree_hashes
from tests.ltx_precomputed import PrecomputedReader
from tests.media_utils import cut_clip
from tests.steps import reconciled

runner = CliRunner()

# --- a loader with PrecomputedDataset's rules -----------------------------------------------------------------------


def precomputed(root: Path, sources: list[str]) -> list[dict[str, dict]]:
    """Every sample the trainer's ``PrecomputedDataset(root, sources)`` yields (`tests.ltx_precomputed`'s reader of
    its rules: the primary source ``latents`` when asked for, else the first; a sample kept only when every other
    source has a file at the same relative path), as {source: record}."""
    reader = PrecomputedReader(root, sources)
    return [{source: reader[i][source] for source in sources} for i in range(len(reader))]


# --- media ------------------------------------------------------------------------------------------------------------


def _frames(media: bytes, count: int) -> np.ndarray:
    """The first `count` frames as rgb24 (the trainer's ``read_video``)."""
    with av.open(io.BytesIO(media)) as container:
        frames = []
        for frame in container.decode(video=0):
            if len(frames) == count:
                break
            frames.append(frame.to_ndarray(format="rgb24"))
    return np.stack(frames)


def _mask_video(source: bytes, frames: int) -> bytes:
    """A mask video made from a real clip: its first frames thresholded to black and white (lossy H.264, as a user's
    mask file would be)."""
    pictures = _frames(source, frames)
    binary = np.where(pictures.mean(axis=3, keepdims=True) > 110, 255, 0).astype(np.uint8).repeat(3, axis=3)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as dst:
        stream = dst.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = binary.shape[2], binary.shape[1], "yuv420p"
        stream.codec_context.thread_count = 1
        for index, picture in enumerate(binary):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out.getvalue()


def _trainer_video_mask(media: bytes, image: bool, latent: tuple[int, int, int]) -> torch.Tensor:
    """``compute_video_masks`` of the trainer, transcribed (scale factors 32×32×8; torchvision's tensor resize is
    ``interpolate(..., "bilinear", align_corners=False, antialias=True)``)."""
    latent_f, latent_h, latent_w = latent
    pixel_h, pixel_w, pixel_f = latent_h * 32, latent_w * 32, (latent_f - 1) * 8 + 1
    if image:
        rgb = np.asarray(Image.open(io.BytesIO(media)).convert("RGB"))
        img = torch.from_numpy(rgb.copy()).permute(2, 0, 1).float().div(255).mean(dim=0, keepdim=True)
        img = F.interpolate(img.unsqueeze(0), [pixel_h, pixel_w], mode="bilinear", antialias=True).squeeze(0)
        mask_pixels = img.expand(pixel_f, -1, -1)
    else:
        video = torch.from_numpy(_frames(media, pixel_f)).float().div(255.0).permute(0, 3, 1, 2)
        frames = video[:pixel_f].mean(dim=1)
        mask_pixels = F.interpolate(frames.unsqueeze(1), size=(pixel_h, pixel_w), mode="nearest").squeeze(1)
    mask_latent = F.avg_pool2d(mask_pixels.unsqueeze(1), kernel_size=32).squeeze(1)
    pad_f = (8 - mask_latent.shape[0] % 8) % 8
    if pad_f > 0:
        mask_latent = F.pad(mask_latent, (0, 0, 0, 0, 0, pad_f))
    mask_latent = mask_latent.reshape(-1, 8, mask_latent.shape[1], mask_latent.shape[2]).amax(dim=1)[:latent_f]
    return (mask_latent > 0.5).float()


def _dataset(root: Path, rows: list[dict], files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    path = root / "dataset.json"
    path.write_text(json.dumps(rows))
    return path


def _config(dataset: Path, model: Path, out: Path, **overrides: object):
    values = {"source": f"meta:{dataset}", "recipe": "ltx2-trainer", "audio": False, **overrides}
    return config(dataset.parent, model, out, **values)


# --- v2v-ic-lora: reference_video → reference_latents/ ---------------------------------------------------------------

V2V = {
    "mode": "v2v-ic-lora",
    "buckets": "64x64x17",
    "reference_downscale_factor": 2,
    "reference_temporal_scale_factor": 2,
}


@pytest.fixture(scope="module")
def v2v(tmp_path_factory: pytest.TempPathFactory, ltx2_model: Path) -> tuple[Path, object, dict]:
    """One v2v-ic-lora cache: two samples with references, one whose reference is not there, one whose reference is
    too short for the bucket."""
    root = tmp_path_factory.mktemp("v2v")
    carphone, bikes = real_clip("carphone").read_bytes(), real_clip("bikes").read_bytes()
    files = {
        "clips/carphone.mp4": carphone,
        "clips/bikes.mp4": bikes,
        "clips/again.mp4": carphone,
        "clips/lonely.mp4": carphone,
        "refs/bikes.mp4": bikes,
        "refs/carphone.mp4": carphone,
        "refs/short.mp4": cut_clip(carphone, 5),
    }
    rows = [
        {"video": "clips/carphone.mp4", "reference_video": "refs/bikes.mp4", "caption": "a call, as bikes"},
        {"video": "clips/bikes.mp4", "reference_video": "refs/carphone.mp4", "caption": "bikes, as a call"},
        {"video": "clips/lonely.mp4", "reference_video": "refs/gone.mp4", "caption": "no reference"},
        {"video": "clips/again.mp4", "reference_video": "refs/short.mp4", "caption": "a short reference"},
    ]
    dataset = _dataset(root / "data", rows, files)
    cfg = _config(dataset, ltx2_model, root / "out", **V2V)
    ok, result = run_build(cfg)
    assert ok and result["done"] == 2 and result["skipped"] == 2, result
    return root / "out", make_plan(cfg), files


def test_v2v_writes_the_reference_as_the_trainer_does(v2v, ltx2_model):
    out, plan, files = v2v
    assert plan.job.kinds == ("latents", "text_embeddings", "reference_latents")
    pre = out / ".precomputed"
    assert sorted(p.name for p in pre.iterdir()) == ["conditions", "latents", "reference_latents"]
    # named by the sample's video, not by the reference's path (the trainer's main_media_relative_path)
    assert sorted(p.name for p in (pre / "reference_latents/clips").iterdir()) == ["bikes.pt", "carphone.pt"]
    reference = torch.load(pre / "reference_latents/clips/carphone.pt", weights_only=True)
    target = torch.load(pre / "latents/clips/carphone.pt", weights_only=True)
    assert set(reference) == set(target) == {"latents", "num_frames", "height", "width", "fps"}
    assert reference["latents"].dtype == target["latents"].dtype == torch.bfloat16
    # the bucket 64x64x17 at 1/2 size: 32x32; 17 frames → frame 0 and every 2nd from 1: 9 frames → 2 latent frames
    assert list(reference["latents"].shape) == [128, 2, 1, 1] and list(target["latents"].shape) == [128, 3, 2, 2]
    assert (reference["num_frames"], reference["height"], reference["width"]) == (2, 1, 1)
    assert reference["fps"] == 25.0 / 2 and target["fps"] == pytest.approx(29.97, abs=0.01)  # bikes' rate over 2
    # the same bytes as the trainer's steps spelled out: first 17 frames, cover-crop to 32², frames [0, 1, 3, ..., 15]
    pixels = resize_pixels(_frames(files["refs/bikes.mp4"], 17), 32, 32, "cover-crop")[:, :, [0, *range(1, 17, 2)]]
    encoder = latent_encoder(load_encoder(plan.job), plan.spec)
    assert torch.equal(encoder.encode_videos([pixels])[0].to(torch.bfloat16), reference["latents"])


def test_v2v_loads_in_the_trainers_dataset_verifies_and_reconciles_by_subfolder(v2v, ltx2_model):
    out, plan, _ = v2v
    loaded = precomputed(out, ["conditions", "latents", "reference_latents"])  # FlexibleStrategyConfig's sources
    report = reconciled(plan)
    assert len(loaded) == report.produced == 2
    verified = runner.invoke(app, ["verify", str(out), "--model", str(ltx2_model), "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.output)["outputs"] == dict.fromkeys(plan.job.kinds, "present")
    inspected = runner.invoke(app, ["inspect", str(out)])
    assert inspected.exit_code == 0, inspected.output
    reasons = {m.id: m.reason for m in report.missing}
    assert reasons == {
        "clips/lonely.mp4": "missing_reference_video",
        "clips/again.mp4": "reference_too_short_for_buckets",
    }
    rows = ledger.read_shard(out, "dataset-00000")
    assert "17" in rows["clips/again.mp4"].detail  # the frames the reference's bucket needs
    # a sample missing from one required subfolder: named, with the subfolder, and the loader drops it
    (out / ".precomputed/reference_latents/clips/bikes.pt").rename(out / "moved.pt")
    try:
        gone = {m.id: m for m in reconciled(plan).missing}["clips/bikes.mp4"]
        assert gone.reason == "file_missing" and ".precomputed/reference_latents/clips/bikes.pt" in gone.detail
        assert len(precomputed(out, ["conditions", "latents", "reference_latents"])) == 1
    finally:
        (out / "moved.pt").rename(out / ".precomputed/reference_latents/clips/bikes.pt")
    # a reference changed in the source makes its sample stale, as a changed video does
    reference = Path(plan.config.source.partition(":")[2]).parent / "refs/bikes.mp4"
    before, stat = reference.read_bytes(), reference.stat()
    reference.write_bytes(before + b"\0")
    try:
        changed = runner.invoke(app, ["verify", str(out), "--model", str(ltx2_model), "--json"])
        assert [s["id"] for s in json.loads(changed.output)["stale"]] == ["clips/carphone.mp4"], changed.output
    finally:
        reference.write_bytes(before)
        os.utime(reference, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_overfit_export_of_a_v2v_cache_keeps_each_kind_in_its_subfolder(v2v, tmp_path):
    out, _, _ = v2v
    to = tmp_path / "overfit"
    exported = runner.invoke(
        app, ["overfit", str(out), "--ids", "clips/carphone.mp4", "--copies", "2", "--to", str(to)]
    )
    assert exported.exit_code == 0, exported.output
    rows = [row for shard in ledger.read_all(to).values() for row in shard.values()]
    assert len(rows) == 2
    for row in rows:
        assert row.file_of("reference_latents").path.startswith(".precomputed/reference_latents/clips/carphone-c")
        assert row.file_of("latents").path.startswith(".precomputed/latents/")
    loaded = precomputed(to, ["conditions", "latents", "reference_latents"])
    assert len(loaded) == 2


def test_the_legacy_reference_column_and_a_file_without_one(tmp_path):
    rows = [{"media_path": "clips/a.mp4", "ref_media_path": "refs/a.mp4", "caption": "a"}]
    dataset = _dataset(tmp_path, rows, {"clips/a.mp4": b"video", "refs/a.mp4": b"reference"})

    class Mode:
        mode = "v2v-ic-lora"

    source = open_source(f"meta:{dataset}", Mode())
    (ref,) = [r for shard in source.shards() for r in source.samples(shard)]
    assert ref.read_roles["reference_video"]() == b"reference" and "reference_video" in ref.identity.members
    (tmp_path / "dataset.json").write_text(json.dumps([{"video": "clips/a.mp4", "caption": "a"}]))
    with pytest.raises(SourceError, match=r"reads the role reference_video .*reference_video or ref_media_path"):
        open_source(f"meta:{dataset}", Mode()).shards()


def test_the_trainers_reference_rules_are_refused_at_plan_time(tmp_path, ltx2_model):
    dataset = _dataset(tmp_path / "data", [{"video": "clips/a.mp4", "reference_video": "r.mp4", "caption": "a"}], {})
    refused = {
        "single resolution bucket only": {**V2V, "buckets": "64x64x17;96x64x17"},
        "does not divide the height 64": {**V2V, "reference_downscale_factor": 5},
        "reference height 16 .* not a multiple of 32": {**V2V, "reference_downscale_factor": 4},
        "17 frames do not subsample evenly": {**V2V, "reference_temporal_scale_factor": 3},
        "subsample to 5, not 8·k \\+ 1": {**V2V, "reference_temporal_scale_factor": 4},
        "scales the reference video of --mode v2v-ic-lora": {"buckets": "64x64x17", "reference_downscale_factor": 2},
        "its reference_video is read from its first frames.*--temporal head": {
            "mode": "v2v-ic-lora",
            "buckets": None,
            "temporal": "span",
            "frames": 17,
            "height": 64,
            "width": 64,
        },
        "its video_mask is read from its first frames": {"mode": "video-inpaint", "temporal": "stride:2"},
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=message):
            make_spec(_config(dataset, ltx2_model, tmp_path / "o", **overrides))
    # factor 1 with several buckets is the trainer's too: each reference picks its own bucket
    spec = make_spec(_config(dataset, ltx2_model, tmp_path / "o", mode="v2v-ic-lora", buckets="64x64x17;96x64x17"))[1]
    assert "reference_latents" in get_family("ltx2").kinds(spec)
    factors = {"reference_downscale_factor": 2}
    assert (
        make_spec(_config(dataset, ltx2_model, tmp_path / "o", **V2V))[1].fingerprint()
        != make_spec(
            _config(dataset, ltx2_model, tmp_path / "o", **{**V2V, **factors, "reference_temporal_scale_factor": 1})
        )[1].fingerprint()
    )


# --- video-inpaint: video_mask → video_masks/ ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inpaint(tmp_path_factory: pytest.TempPathFactory, ltx2_model: Path) -> tuple[Path, object, dict]:
    """One video-inpaint cache at 128x96x9 (latents 3x4 per frame): a mask video made from a real clip, a still
    mask image, and a mask video too short for the latents' frames."""
    root = tmp_path_factory.mktemp("inpaint")
    carphone, bikes = real_clip("carphone").read_bytes(), real_clip("bikes").read_bytes()
    still = Image.new("L", (90, 50), 0)
    still.paste(255, (10, 5, 60, 40))
    png = io.BytesIO()
    still.save(png, format="PNG")
    files = {
        "clips/carphone.mp4": carphone,
        "clips/bikes.mp4": bikes,
        "clips/short.mp4": carphone,
        "masks/carphone.mp4": _mask_video(carphone, 12),
        "masks/box.png": png.getvalue(),
        "masks/short.mp4": _mask_video(carphone, 4),
    }
    rows = [
        {"video": "clips/carphone.mp4", "video_mask": "masks/carphone.mp4", "caption": "a call"},
        {"video": "clips/bikes.mp4", "video_mask": "masks/box.png", "caption": "bikes"},
        {"video": "clips/short.mp4", "video_mask": "masks/short.mp4", "caption": "a short mask"},
    ]
    dataset = _dataset(root / "data", rows, files)
    cfg = _config(dataset, ltx2_model, root / "out", mode="video-inpaint", buckets="128x96x9")
    ok, result = run_build(cfg)
    assert ok and result["done"] == 2 and result["skipped"] == 1, result
    return root / "out", make_plan(cfg), files


def test_video_masks_are_the_trainers_on_the_latent_grid(inpaint):
    out, plan, files = inpaint
    assert plan.job.kinds == ("latents", "text_embeddings", "video_masks")
    pre = out / ".precomputed"
    assert sorted(p.name for p in pre.iterdir()) == ["conditions", "latents", "video_masks"]
    for stem, mask_file in (("carphone", "masks/carphone.mp4"), ("bikes", "masks/box.png")):
        mask = torch.load(pre / f"video_masks/clips/{stem}.pt", weights_only=True)
        latents = torch.load(pre / f"latents/clips/{stem}.pt", weights_only=True)
        assert set(mask) == {"mask"} and mask["mask"].dtype == torch.float32
        grid = (latents["num_frames"], latents["height"], latents["width"])
        assert tuple(mask["mask"].shape) == grid == (2, 3, 4), stem  # aligned with the latents it masks
        expected = _trainer_video_mask(files[mask_file], mask_file.endswith(".png"), grid)
        assert torch.equal(mask["mask"], expected), stem
        assert 0 < int(mask["mask"].sum()) < mask["mask"].numel(), stem  # a real mask: some of each
    rows = ledger.read_shard(out, "dataset-00000")
    assert rows["clips/short.mp4"].reason == "video_mask_too_short"


def test_video_inpaint_loads_in_the_trainers_dataset(inpaint):
    out, plan, _ = inpaint
    loaded = precomputed(out, ["conditions", "latents", "video_masks"])
    assert len(loaded) == reconciled(plan).produced == 2
    for sample in loaded:  # the strategy's reshape: one mask value per video token
        _, frames, height, width = sample["latents"]["latents"].shape
        assert sample["video_masks"]["mask"].reshape(1, frames * height * width).shape == (1, frames * height * width)


# --- av2av-ic-lora: reference_audio → reference_audio_latents/ -------------------------------------------------------


@pytest.mark.parametrize("made", ["v2v", "inpaint"])
def test_decoder_processes_decode_references_and_masks_as_threads_do(made, request, ltx2_model, tmp_path):
    """`--decode-pool process` runs the same decoding as the threads (`decode_media`): a v2v and a video-inpaint
    build on two decoder processes write the thread build's files byte for byte, and skip the same samples."""
    out, plan, _ = request.getfixturevalue(made)
    overrides = {**V2V} if made == "v2v" else {"mode": "video-inpaint", "buckets": "128x96x9"}
    dataset = out.parent / "data" / "dataset.json"
    cfg = _config(dataset, ltx2_model, tmp_path / "out", **overrides, decode_pool="process", decode_workers=2)
    ok, result = run_build(cfg)
    assert ok, result
    assert (result["done"], result["skipped"]) == (reconciled(plan).produced, 2 if made == "v2v" else 1)
    ours = {k: v for k, v in tree_hashes(tmp_path / "out").items() if k.startswith(".precomputed")}
    assert ours and ours == {k: v for k, v in tree_hashes(out).items() if k.startswith(".precomputed")}


@pytest.fixture(scope="module")
def av2av(tmp_path_factory: pytest.TempPathFactory, ltx2_model: Path) -> tuple[Path, object, dict]:
    """One av2av-ic-lora cache at 64x64x9 under the ltx2-trainer recipe (audio on, the trainer's audio length):
    bigbuckbunny (AAC 5.1, 48 kHz) and audio_only (46 ms) as audio and reference audio, and a reference audio file
    without an audio track."""
    root = tmp_path_factory.mktemp("av2av")
    names = ("carphone", "bikes", "bigbuckbunny", "audio_only")
    media = {name: real_clip(name).read_bytes() for name in names}
    files = {f"clips/{name}.mp4": data for name, data in media.items()} | {"clips/silent.mp4": media["carphone"]}
    rows = [
        {
            "video": "clips/carphone.mp4",
            "audio": "clips/bigbuckbunny.mp4",
            "reference_video": "clips/bikes.mp4",
            "reference_audio": "clips/audio_only.mp4",
            "caption": "a call",
        },
        {
            "video": "clips/bikes.mp4",
            "audio": "clips/audio_only.mp4",
            "reference_video": "clips/carphone.mp4",
            "reference_audio": "clips/bigbuckbunny.mp4",
            "caption": "bikes",
        },
        {
            "video": "clips/silent.mp4",
            "audio": "clips/bigbuckbunny.mp4",
            "reference_video": "clips/bikes.mp4",
            "reference_audio": "clips/carphone.mp4",
            "caption": "a reference without sound",
        },
    ]
    dataset = _dataset(root / "data", rows, files)
    cfg = _config(dataset, ltx2_model, root / "out", mode="av2av-ic-lora", buckets="64x64x9", audio=True)
    ok, result = run_build(cfg)
    assert ok and result["done"] == 3, result
    return root / "out", make_plan(cfg), files


def test_av2av_writes_the_reference_audio_as_the_trainer_does(av2av):
    out, plan, _ = av2av
    kinds = ("latents", "text_embeddings", "audio_latents", "reference_latents", "reference_audio_latents")
    assert plan.job.kinds == kinds
    pre = out / ".precomputed"
    assert sorted(p.name for p in pre.iterdir()) == sorted(["conditions", *kinds[:1], *kinds[2:]])
    reference = torch.load(pre / "reference_audio_latents/clips/bikes.pt", weights_only=True)
    assert set(reference) == {"latents", "num_time_steps", "frequency_bins", "duration"}
    assert reference["latents"].dtype == torch.float32 and reference["latents"].shape[::2] == (8, 16)
    assert reference["num_time_steps"] == reference["latents"].shape[1] and reference["frequency_bins"] == 16
    # the audio column's rule (compute_audio_latents, max_duration = the longest bucket's F / 25): 9 / 25 s trimmed
    assert reference["duration"] == int(9 / 25 * 48000) / 48000
    # the same file as another sample's audio column: the same latents (one encoder, one rule, any role)
    audio = torch.load(pre / "audio_latents/clips/carphone.pt", weights_only=True)
    assert torch.equal(reference["latents"], audio["latents"]) and reference["duration"] == audio["duration"]
    short = torch.load(pre / "reference_audio_latents/clips/carphone.pt", weights_only=True)
    assert short["duration"] < 0.1  # the 46 ms file: trimmed only, never padded
    video = torch.load(pre / "reference_latents/clips/carphone.pt", weights_only=True)
    assert list(video["latents"].shape) == [128, 2, 2, 2] and video["fps"] == 25.0  # bikes, full size and rate


def test_av2av_loads_in_the_trainers_dataset_and_a_reference_without_sound_is_named(av2av):
    out, plan, _ = av2av
    sources = ["conditions", "latents", "audio_latents", "reference_latents", "reference_audio_latents"]
    loaded = precomputed(out, sources)
    report = reconciled(plan)
    assert len(loaded) == report.produced == 2
    (missing,) = report.missing
    assert (missing.id, missing.reason) == ("clips/silent.mp4", "no_audio_track")
    assert "reference_audio_latents" in missing.detail


# --- audio-only modes: t2a (--audio-durations), a2a-ic-lora, audio-inpaint -------------------------------------------


def _wav(samples: np.ndarray, rate: int) -> bytes:
    """int16 PCM WAV bytes of float samples (channels, n) in [-1, 1]."""
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(samples.shape[0])
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((np.clip(samples, -1, 1) * 32767).round().astype("<i2").T.tobytes())
    return out.getvalue()


def _bunny_wav(seconds: float) -> bytes:
    """The first `seconds` of bigbuckbunny's real soundtrack (its front left and right channels) as a WAV."""
    chunks, rate = [], 48000
    with av.open(str(real_clip("bigbuckbunny"))) as container:
        for frame in container.decode(audio=0):
            chunks.append(frame.to_ndarray()[:2])
            rate = frame.sample_rate
    samples = np.concatenate(chunks, axis=1)[:, : int(seconds * rate)]
    return _wav(samples, rate)


def _audio_build(root: Path, model: Path, mode: str, rows: list[dict], files: dict, **overrides: object) -> tuple:
    dataset = _dataset(root / "data", rows, files)
    cfg = _config(dataset, model, root / "out", mode=mode, audio=True, **overrides)
    ok, result = run_build(cfg)
    assert ok, result
    return root / "out", make_plan(cfg), result


@pytest.fixture(scope="module")
def audio_files() -> dict[str, bytes]:
    return {
        "clips/bunny.wav": _bunny_wav(2.5),
        "clips/bigbuckbunny.mp4": real_clip("bigbuckbunny").read_bytes(),
        "clips/audio_only.mp4": real_clip("audio_only").read_bytes(),
        "clips/carphone.mp4": real_clip("carphone").read_bytes(),
    }


def test_t2a_from_audio_and_captions_with_duration_buckets(tmp_path, ltx2_model, audio_files):
    rows = [
        {"audio": "clips/bunny.wav", "caption": "a meadow"},
        {"audio": "clips/bigbuckbunny.mp4", "caption": "a rabbit"},
        {"audio": "clips/audio_only.mp4", "caption": "46 ms"},
        {"audio": "clips/carphone.mp4", "caption": "no sound"},
    ]
    out, plan, result = _audio_build(
        tmp_path, ltx2_model, "t2a", rows, audio_files, audio_durations="4.0;1.0", decode_samples=2
    )
    assert plan.job.kinds == ("text_embeddings", "audio_latents") and plan.spec.audio_durations == [4.0, 1.0]
    assert result["done"] == 2 and result["skipped"] == 2, result
    pre = out / ".precomputed"
    assert sorted(p.name for p in pre.iterdir()) == ["audio_latents", "conditions"]  # no latents/
    expected = {"bunny": (1.0, "clips/bunny.wav"), "bigbuckbunny": (4.0, "clips/bigbuckbunny.mp4")}
    encoder = load_encoder(plan.job)
    for stem, (seconds, name) in expected.items():  # the longest bucket that fits: 2.5 s → 1.0, 5.3 s → 4.0
        record = torch.load(pre / f"audio_latents/clips/{stem}.pt", weights_only=True)
        assert set(record) == {"latents", "num_time_steps", "frequency_bins", "duration"}
        assert record["latents"].dtype == torch.float32 and record["duration"] == seconds, stem
        assert torch.equal(record["latents"], encoder.encode_audio(audio_files[name], seconds, False).latents), stem
        assert (pre / f"conditions/clips/{stem}.pt").is_file()  # named by the audio file, as the trainer names it
    loaded = precomputed(out, ["conditions", "audio_latents"])  # no latents/: the first source leads
    report = reconciled(plan)
    assert len(loaded) == report.produced == 2
    verified = runner.invoke(app, ["verify", str(out), "--model", str(ltx2_model), "--json"])
    outputs = dict.fromkeys(plan.job.kinds, "present")
    assert verified.exit_code == 0 and json.loads(verified.output)["outputs"] == outputs
    refused = runner.invoke(app, ["overfit", str(out), "--n", "1", "--to", str(tmp_path / "overfit")])
    assert refused.exit_code == 2 and "holds no video latents" in refused.output, refused.output
    dataset = tmp_path / "data/dataset.json"
    ok, dry = run_build(_config(dataset, ltx2_model, tmp_path / "dry", mode="t2a", audio=True, dry_run=True))
    assert ok and "audio_latents" in dry["dry_run"] and "latents" not in dry["dry_run"], dry
    for step, code in (("inspect", 0), ("audio-check", 0), ("reconcile", 1)):  # reconcile: 2 of 4 missing
        ran = runner.invoke(app, [step, str(out)])
        assert ran.exit_code == code, (step, ran.output)
    reasons = {m.id: m.reason for m in report.missing}
    assert reasons == {"clips/audio_only.mp4": "audio_too_short", "clips/carphone.mp4": "no_audio_track"}
    refused = {
        "for the audio-only modes": {"audio_durations": "1.0", "buckets": "64x64x9"},
        "must be positive": {"audio_durations": "1;0", "mode": "t2a", "audio": True},
    }
    for message, overrides in refused.items():  # a value that is not a duration is refused by the config itself
        with pytest.raises((ConfigError, ValidationError), match=message):
            make_spec(_config(tmp_path / "data/dataset.json", ltx2_model, tmp_path / "o", **overrides))


def test_a2a_reference_audio_is_named_by_the_sample(tmp_path, ltx2_model, audio_files):
    rows = [
        {"audio": "clips/bunny.wav", "reference_audio": "clips/bigbuckbunny.mp4", "caption": "a meadow"},
        {"audio": "clips/bigbuckbunny.mp4", "reference_audio": "clips/carphone.mp4", "caption": "no reference sound"},
    ]
    out, plan, result = _audio_build(tmp_path, ltx2_model, "a2a-ic-lora", rows, audio_files)
    assert result["done"] == 2, result
    pre = out / ".precomputed"
    assert sorted(p.name for p in pre.iterdir()) == ["audio_latents", "conditions", "reference_audio_latents"]
    target = torch.load(pre / "audio_latents/clips/bunny.pt", weights_only=True)
    reference = torch.load(pre / "reference_audio_latents/clips/bunny.pt", weights_only=True)
    assert target["duration"] == 2.5 and reference["duration"] == pytest.approx(5.28, abs=0.05)  # whole files
    whole = load_encoder(plan.job).encode_audio(audio_files["clips/bigbuckbunny.mp4"], 60.0, False)
    assert torch.equal(reference["latents"], whole.latents) and reference["duration"] == whole.duration
    loaded = precomputed(out, ["conditions", "audio_latents", "reference_audio_latents"])
    report = reconciled(plan)
    assert len(loaded) == report.produced == 1
    (missing,) = report.missing
    assert missing.id == "clips/bigbuckbunny.mp4" and missing.reason == "no_audio_track"
    assert "reference_audio_latents" in missing.detail


def test_audio_masks_are_the_trainers_on_the_audio_latents_steps(tmp_path, ltx2_model, audio_files):
    tensor_mask = torch.cat([torch.ones(30), torch.zeros(70)])
    buffer = io.BytesIO()
    torch.save({"mask": tensor_mask}, buffer)
    square = np.zeros((1, 48000), dtype=np.float32)
    square[:, 12000:30000] = 0.9  # a gate signal: loud from 0.25 s to 0.625 s
    files = {**audio_files, "masks/bunny.pt": buffer.getvalue(), "masks/gate.wav": _wav(square, 48000)}
    rows = [
        {"audio": "clips/bunny.wav", "audio_mask": "masks/bunny.pt", "caption": "a meadow"},
        {"audio": "clips/bigbuckbunny.mp4", "audio_mask": "masks/gate.wav", "caption": "a rabbit"},
    ]
    out, plan, result = _audio_build(tmp_path, ltx2_model, "audio-inpaint", rows, files, audio_durations="2.0")
    assert result["done"] == 2, result
    pre = out / ".precomputed"
    assert sorted(p.name for p in pre.iterdir()) == ["audio_latents", "audio_masks", "conditions"]
    raw = {"bunny": tensor_mask, "bigbuckbunny": torch.from_numpy(square).abs().mean(dim=0)}  # torchaudio's /32768
    raw["bigbuckbunny"] = torch.from_numpy(np.round(square * 32767) / 32768).abs().mean(dim=0)
    for stem, signal in raw.items():
        mask = torch.load(pre / f"audio_masks/clips/{stem}.pt", weights_only=True)
        steps = torch.load(pre / f"audio_latents/clips/{stem}.pt", weights_only=True)["num_time_steps"]
        assert set(mask) == {"mask"} and mask["mask"].dtype == torch.float32 and mask["mask"].shape == (steps,)
        expected = F.interpolate(signal.float().unsqueeze(0).unsqueeze(0), size=steps, mode="nearest").squeeze()
        assert torch.equal(mask["mask"], (expected > 0.5).float()), stem
        assert 0 < int(mask["mask"].sum()) < steps, stem
    loaded = precomputed(out, ["conditions", "audio_latents", "audio_masks"])
    assert len(loaded) == reconciled(plan).produced == 2


def test_a_still_mask_in_any_of_the_trainers_image_formats():
    still = Image.new("RGB", (90, 50), (0, 0, 0))
    still.paste((255, 255, 255), (10, 5, 60, 40))
    masks = {}
    for fmt in ("PNG", "BMP", "TIFF"):
        data = io.BytesIO()
        still.save(data, format=fmt)
        masks[fmt] = video_mask(data.getvalue(), (2, 3, 4), 32, 8)
    png = io.BytesIO()
    still.save(png, format="PNG")
    expected = _trainer_video_mask(png.getvalue(), True, (2, 3, 4))
    assert all(torch.equal(mask, expected) for mask in masks.values()), masks
