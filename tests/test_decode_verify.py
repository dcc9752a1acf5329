"""Decode-and-verify: the metrics on hand-checkable cases, the sample choice, and the whole check on a cache built
with a tiny real-architecture Wan2.2 VAE trained here to reconstruct its clips, against corrupted latents."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import logging
import re
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from PIL import Image
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra import report_files as reports
from infra.audit.decode_verify import (
    ARTIFACT_BYTES,
    DecodedSample,
    DecodeReport,
    choose_samples,
    decode_and_verify,
    mel_picture,
)
from infra.audit.metrics import K1, psnr, ssim
from infra.cache import ledger
from infra.cache.cachedir import read_cache_json
from infra.cache.ledger import LedgerRow
from infra.demo.vae_fit.train import FitSettings, fit_vae
from infra.media.resize import frames_to_pixels
from infra.media.video import sample_frames
from tests.conftest import HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip

logger = logging.getLogger(__name__)
runner = CliRunner()

FRAMES = 5  # the trained geometry: 5 × 48 × 80, two latent frames (the first-frame path and one 4-frame chunk)
FIT_STEPS = 30
GOOD_PSNR = 20.0  # measured 21.4 dB (bikes) and 22.7 dB (carphone) after the fit; untrained: 11.9 dB
CORRUPTION_DROP = 6.0  # dB a corrupted latent must lose (measured: 18.4 shuffled, 14.9 swapped)


def _video(seed: int, shape: tuple[int, ...] = (3, 2, 24, 32)) -> torch.Tensor:
    """Random pixels in [-0.8, 0.8], float64 (so an offset is exact to ~1e-16)."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.6 - 0.8


def test_psnr_of_a_constant_offset_is_exact():
    reference = _video(0)
    assert psnr(reference, reference + 0.2) == pytest.approx(20.0, abs=1e-9)  # 0.1 in [0, 1] units: MSE 0.01
    assert psnr(reference, reference - 0.02) == pytest.approx(40.0, abs=1e-9)  # 0.01: MSE 1e-4


def test_identical_videos_give_infinite_psnr_and_ssim_one():
    video = _video(1)
    assert psnr(video, video.clone()) == float("inf")
    assert ssim(video, video.clone()) == 1.0


def test_ssim_of_flat_frames_is_the_luminance_term():
    # constant frames: zero variance, so SSIM = (2ab + C1) / (a² + b² + C1) with a, b in [0, 1]
    a, b = 0.25, 0.75
    got = ssim(torch.full((3, 2, 16, 16), 2 * a - 1), torch.full((3, 2, 16, 16), 2 * b - 1))
    assert got == pytest.approx((2 * a * b + K1**2) / (a * a + b * b + K1**2), rel=1e-9)


def test_ssim_with_noise_is_below_one_and_symmetric():
    video = _video(2)
    noisy = (video + 0.1 * torch.randn(video.shape, generator=torch.Generator().manual_seed(3))).clamp(-1, 1)
    more = (video + 0.4 * torch.randn(video.shape, generator=torch.Generator().manual_seed(4))).clamp(-1, 1)
    assert 0 < ssim(video, more) < ssim(video, noisy) < 1
    assert ssim(video, noisy) == ssim(noisy, video)
    assert psnr(video, noisy) == psnr(noisy, video) > psnr(video, more)
    with pytest.raises(ValueError, match="shapes differ"):
        ssim(video, video[:, :1])


def _skimage_ssim(reference: torch.Tensor, test: torch.Tensor) -> float:
    """scikit-image's SSIM, as Wang et al. define it (Gaussian window, σ 1.5, population covariance), per frame of
    each channel on [0, 1] pixels, averaged: the library's numbers, not a second copy of ours."""
    x, y = ((v.numpy() + 1) / 2 for v in (reference, test))
    scores = [
        structural_similarity(a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0)
        for x_c, y_c in zip(x, y, strict=True)
        for a, b in zip(x_c, y_c, strict=True)
    ]
    return float(np.mean(scores))


def test_ssim_and_psnr_match_scikit_image():
    video = _video(5, (3, 4, 40, 57))
    for scale in (0.02, 0.3):
        noise = torch.randn(video.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        other = (video + scale * noise).clamp(-1, 1)
        assert ssim(video, other) == pytest.approx(_skimage_ssim(video, other), rel=1e-9)
        reference = peak_signal_noise_ratio(((video + 1) / 2).numpy(), ((other + 1) / 2).numpy(), data_range=1.0)
        assert psnr(video, other) == pytest.approx(reference, rel=1e-9)


def _row(group: str, index: int, status: str = "done", shard: str = "s0") -> LedgerRow:
    return LedgerRow(
        key=f"{group}/{index}",
        id=f"t_{index:08d}",
        group=group,
        shard=shard,
        status=status,
        path=f"{group}/t_{index:08d}.pt",
    )


def test_choice_is_done_rows_spread_over_groups_and_deterministic():
    rows = [_row("b", i) for i in (2, 0, 1)] + [_row("a", 1), _row("a", 0, shard="s1"), _row("a", 2, "failed")]
    rows += [_row("c", 0), _row("c", 1, "skipped")]
    names = [(r.group, r.id[-1]) for r in choose_samples(rows, 4)]
    assert names == [("a", "0"), ("b", "0"), ("c", "0"), ("a", "1")]
    assert choose_samples(reversed(rows), 4) == choose_samples(rows, 4)
    everything = [(r.group, r.id[-1]) for r in choose_samples(rows, None)]
    assert everything == [("a", "0"), ("b", "0"), ("c", "0"), ("a", "1"), ("b", "1"), ("b", "2")]
    assert choose_samples(rows, 0) == [] and choose_samples([], None) == []


@pytest.fixture(scope="module")
def training_clips(clips: dict[str, bytes]) -> dict[str, bytes]:
    """Two real clips with different content (cut and downscaled as in the build tests)."""
    return {"bikes": cut_clip(clips["bikes"], 12, width=160), "carphone": cut_clip(clips["carphone"], 12)}


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, training_clips) -> Path:
    """The tiny model with its VAE (real Wan2.2 structure, z_dim 48) fitted to the two clips at the cache's
    geometry by `make-tiny-model --train-on`'s fit (closed-form start, then a short fine-tune)."""
    model = tmp_path_factory.mktemp("models") / "trained-wan22"
    shutil.copytree(tiny_model, model)
    vae = AutoencoderKLWan.from_pretrained(tiny_model / "vae", local_files_only=True)
    pixels = [frames_to_pixels(sample_frames(v, FRAMES).frames, HEIGHT, WIDTH) for v in training_clips.values()]
    result = fit_vae(vae, pixels, FitSettings(steps=FIT_STEPS))
    logger.info("fitted the tiny VAE: %d steps in %.1f s", result.steps, result.seconds)
    shutil.rmtree(model / "vae")
    vae.register_to_config(clip_output=False)  # as the real vae/config.json
    vae.save_pretrained(model / "vae", safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, trained_model: Path, training_clips) -> Path:
    """A cache of both clips in both groups (two shards), encoded by the trained VAE at 5 × 48 × 80."""
    root = tmp_path_factory.mktemp("decode")
    bikes, carphone = training_clips["bikes"], training_clips["carphone"]
    src = make_shards(
        root / "src",
        {
            "G-11_part-00000": [sample(0, 0, bikes, b"a cyclist"), sample(0, 1, carphone, b"a call")],
            "O-21_part-00000": [sample(1, 0, carphone, b"a call"), sample(1, 1, bikes, b"a cyclist")],
        },
    )
    ok, result = run_build(config(src, trained_model, root / "out", frames=FRAMES))
    assert ok and result["done"] == 4, result
    return root / "out"


def _source_pixels(video: bytes) -> torch.Tensor:
    """The recipe's pixels of a clip, (3, F, H, W)."""
    return frames_to_pixels(sample_frames(video, FRAMES).frames, HEIGHT, WIDTH)[0]


def _clip_of(group: str, sample_id: str) -> str:
    """Which clip a sample holds: in G-11 index 0 is bikes, in O-21 index 0 is carphone (see `built`)."""
    first = "bikes" if group.startswith("G-11") else "carphone"
    return first if sample_id.endswith("0") else ({"bikes", "carphone"} - {first}).pop()


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_decode_writes_videos_strips_and_metrics(built, training_clips):
    report = decode_and_verify(built, n=3, device="cpu")
    every = [r for rows in ledger.read_all(built).values() for r in rows.values()]
    assert [(r.group, r.id) for r in report.rows] == [(r.group, r.id) for r in choose_samples(every, 3)]
    assert len({r.group for r in report.rows}) == 2 and not report.problems and report.ok
    assert Path(report.report_dir) == built / "reports" / "decode"
    for row in report.rows:
        logger.info("decoded %s/%s: PSNR %.2f dB, SSIM %.4f", row.group, row.id, row.psnr, row.ssim)
        assert row.psnr >= GOOD_PSNR and 0.5 < row.ssim <= 1 and row.frames == FRAMES
        assert Path(row.mp4) == built / "reports" / "decode" / row.group / f"{row.id}.mp4"
        with av.open(row.mp4) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == FRAMES and frames[0].shape == (HEIGHT, 2 * WIDTH, 3)
        source = _source_pixels(training_clips[_clip_of(row.group, row.id)])
        expected = ((source[:, 0].permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
        left = torch.from_numpy(frames[0][:, :WIDTH]).permute(2, 0, 1)[:, None].float() / 127.5 - 1
        assert psnr(source[:, :1], left) > 30  # the left half is the source (H.264, near lossless)
        strip = np.asarray(Image.open(row.png).convert("RGB"))
        assert strip.shape == (2 * HEIGHT, 3 * WIDTH, 3)
        assert np.array_equal(strip[:HEIGHT, :WIDTH], expected)  # top left: the source's first frame, lossless
    assert report.strip_paths == [Path(r.png) for r in report.rows]
    saved = json.loads((built / "reports" / "decode" / "report.json").read_text())
    assert saved["ok"] is True and [r["id"] for r in saved["rows"]] == [r.id for r in report.rows]
    json.dumps(report.table(), allow_nan=False)
    assert "decode-verify: REPORTED" in report.markdown() and "PSNR" in report.text()

    before = _hashes(built / "reports")
    again = decode_and_verify(built, n=3, device="cpu")  # the names exist: a new run folder, nothing replaced
    assert Path(again.report_dir).parent == built / "reports" / "decode"
    assert {k: v for k, v in _hashes(built / "reports").items() if k in before} == before
    assert [r.psnr for r in again.rows] == [r.psnr for r in report.rows]


def test_all_samples_and_the_psnr_gate(built, tmp_path):
    psnr_gate = 22.0  # between the two clips: bikes ~21.4 dB, carphone ~22.7 dB
    every = decode_and_verify(built, n=None, device="cpu", min_psnr=psnr_gate, report_dir=tmp_path / "all")
    psnrs = sorted(r.psnr for r in every.rows)
    assert len(psnrs) == 4 and not every.problems and psnrs[0] < psnr_gate < psnrs[-1]
    assert not every.ok and "FAILED" in every.text() and json.loads((tmp_path / "all" / "report.json").read_text())
    assert dataclasses.replace(every, min_psnr=psnrs[0]).ok  # at the threshold passes
    assert dataclasses.replace(every, min_psnr=None).ok  # no gate: numbers reported, not judged


def _corrupt(copy: Path, relpath: str, x0: torch.Tensor) -> None:
    """Replace a stored sample's x0 (in a copy of the cache), keeping the rest of the record."""
    record = torch.load(copy / relpath, weights_only=True)
    torch.save(record | {"x0": x0.contiguous()}, copy / relpath)


def test_a_corrupted_latent_scores_far_lower(built, tmp_path):
    good = decode_and_verify(built, n=None, device="cpu", min_psnr=GOOD_PSNR, report_dir=tmp_path / "good")
    copy = tmp_path / "copy"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("reports"))
    by_clip = {_clip_of(r.group, r.id): r for r in good.rows if r.group.startswith("G-11")}
    bikes, carphone = by_clip["bikes"], by_clip["carphone"]
    x0 = torch.load(copy / bikes.path, weights_only=True)["x0"]
    shuffled = x0.flatten()[torch.randperm(x0.numel(), generator=torch.Generator().manual_seed(0))]
    _corrupt(copy, bikes.path, shuffled.view_as(x0))  # the right values in the wrong places
    _corrupt(copy, carphone.path, x0)  # another sample's latents
    bad = decode_and_verify(copy, n=None, device="cpu", min_psnr=GOOD_PSNR, report_dir=tmp_path / "bad")
    assert good.ok and not bad.ok and not bad.problems
    before, after = ({(r.group, r.id): r for r in rep.rows} for rep in (good, bad))
    for (group, sample_id), row in before.items():
        changed = after[group, sample_id]
        logger.info(
            "%s: PSNR %.2f → %.2f dB, SSIM %.4f → %.4f", sample_id, row.psnr, changed.psnr, row.ssim, changed.ssim
        )
        if row.path in (bikes.path, carphone.path):
            assert changed.psnr <= row.psnr - CORRUPTION_DROP and changed.ssim < row.ssim - 0.2
        else:
            assert (changed.psnr, changed.ssim) == (row.psnr, row.ssim)


def test_problems_are_recorded_not_raised(built, tmp_path, tiny_model):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("reports"))
    rows = choose_samples([r for rows in ledger.read_all(copy).values() for r in rows.values()], None)
    (copy / rows[0].path).unlink()
    src = Path(read_cache_json(copy)["provenance"]["source"].split(":", 1)[1])
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(src / f"{rows[0].shard}.tar", partial)  # the other shard is gone
    report: DecodeReport = decode_and_verify(copy, n=None, source=f"vbvr:{partial}", report_dir=tmp_path / "r")
    assert len(report.rows) == 1 and len(report.problems) == 3 and report.ok  # reported, not judged
    problems = {p.id: p.problem for p in report.problems}
    assert "FileNotFoundError" in problems[rows[0].id]
    assert sum("is not in the source" in text for text in problems.values()) == 2
    assert not dataclasses.replace(report, min_psnr=0.0).ok  # a gate fails on a sample it could not check

    moved = decode_and_verify(built, n=2, source=f"vbvr:{tmp_path / 'nowhere'}", report_dir=tmp_path / "m")
    assert not moved.rows and all("cannot be listed" in p.problem for p in moved.problems)

    untrained = decode_and_verify(built, n=1, model_dir=tiny_model, report_dir=tmp_path / "u")
    assert untrained.problems[0].problem.startswith("the VAE in") and untrained.rows[0].psnr < GOOD_PSNR - 6


@pytest.fixture(scope="module")
def folder_cache(tmp_path_factory: pytest.TempPathFactory, trained_model: Path, training_clips) -> Path:
    """A folder source whose one group holds two clips of the same file name: G-11/{near,far}/video.mp4."""
    root = tmp_path_factory.mktemp("same-names")
    for sub, clip in (("near", "bikes"), ("far", "carphone")):
        (root / "src" / "G-11" / sub).mkdir(parents=True)
        (root / "src" / "G-11" / sub / "video.mp4").write_bytes(training_clips[clip])
        (root / "src" / "G-11" / sub / "video.txt").write_text(f"a {clip} clip")
    ok, result = run_build(
        config(root / "src", trained_model, root / "out", frames=FRAMES, source=f"folder:{root / 'src'}")
    )
    assert ok and result["done"] == 2, result
    return root / "out"


def test_two_clips_of_one_name_in_a_group_get_their_own_files(folder_cache, tmp_path):
    """Through the CLI: decode names each sample's files by its output stem (G-11/near/video.png, not
    G-11/video.png twice), so the gate judges both, and overfit's references are reference/G-11/near/video.mp4."""
    decode = runner.invoke(app, ["decode", str(folder_cache), "--all", "--min-psnr", str(GOOD_PSNR - 1)])
    assert decode.exit_code == 0, decode.output
    assert "OK (2 sample(s)" in decode.output and "0 problem(s)" in decode.output
    folder = folder_cache / "reports" / "decode"
    saved = json.loads((folder / "report.json").read_text())
    assert sorted(r["stem"] for r in saved["rows"]) == ["G-11/far/video", "G-11/near/video"]
    for sub in ("near", "far"):
        assert (folder / "G-11" / sub / "video.png").is_file() and (folder / "G-11" / sub / "video.mp4").is_file()
    to = tmp_path / "overfit"
    overfit = runner.invoke(app, ["overfit", str(folder_cache), "--n", "2", "--to", str(to)])
    assert overfit.exit_code == 0, overfit.output
    refs = sorted(str(p.relative_to(to / "reference")) for p in (to / "reference").rglob("*.mp4"))
    assert refs == ["G-11/far/video.mp4", "G-11/near/video.mp4"]


def _data_uris(markdown: str) -> list[np.ndarray]:
    """The pictures embedded in a markdown text, decoded."""
    found = re.findall(r"\]\((data:image/png;base64,[A-Za-z0-9+/=]+)\)", markdown)
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")) for uri in found]


def test_the_artifact_draws_every_strip_within_the_size_limit(built, tmp_path):
    report = decode_and_verify(built, n=None, device="cpu", report_dir=tmp_path / "r")
    text = report.artifact_markdown()
    assert len(text) <= ARTIFACT_BYTES
    pictures = _data_uris(text)
    assert len(pictures) == len(report.rows) == 4
    for row, picture in zip(report.rows, pictures, strict=True):
        strip = np.asarray(Image.open(row.png).convert("RGB"))  # 2·48 × 3·80: enlarged ×2 (pixels repeated)
        assert np.array_equal(picture, strip.repeat(2, axis=0).repeat(2, axis=1))
        assert f"**PSNR {row.psnr:.2f} dB · SSIM {row.ssim:.4f}** · `{row.stem}`" in text
    header = "| psnr | ssim | frames | sample |"  # the numbers first, the long name last
    assert header in text and header in report.markdown()
    on_disk = (tmp_path / "r" / "report.md").read_text()
    assert f"]({report.rows[0].stem}.png)" in on_disk and "data:" not in on_disk  # report.md links its files
    assert list(report.table()[0])[:3] == ["psnr", "ssim", "frames"]

    small = report.artifact_markdown(max_chars=len(report.markdown()) + 2000)  # no room: named, not drawn
    assert not _data_uris(small) and all(f"(strip not drawn here: {row.png})" in small for row in report.rows)


def test_a_big_strip_is_made_small_enough_to_embed(clips):
    frames = sample_frames(clips["sample_1080p"], 3).frames  # real detail: a 832² strip PNG is ~8 MB
    pixels = frames_to_pixels(frames, 416, 416)[0]
    strip = ((pixels.permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    row = np.concatenate(list(strip), axis=1)
    buffer = io.BytesIO()
    Image.fromarray(np.concatenate([row, row], axis=0)).save(buffer, format="PNG")
    everything = reports.png_data_uri(buffer.getvalue(), 10**8)
    assert everything.width == 640 and not everything.palette  # never wider than the largest embed width
    for limit in (200_000, 60_000, 20_000):
        shrunk = reports.png_data_uri(buffer.getvalue(), limit)
        assert shrunk is not None and len(shrunk.uri) <= limit and shrunk.width < 640
    assert reports.png_data_uri(buffer.getvalue(), 2_000) is None


def test_the_mel_picture_puts_the_source_above_the_decoded(tmp_path):
    reference = torch.linspace(-4, 2, 64).expand(2, 10, 64)  # [C, T, M]: louder at higher bands
    decoded = torch.full((2, 10, 64), -4.0)
    picture = np.asarray(Image.open(io.BytesIO(mel_picture(reference, decoded))))
    assert picture.shape == ((64 + 2 + 64) * 2, 10 * 2)
    assert picture[0, 0] == 255 and picture[127, 0] == 0  # top band loudest, bottom band quietest (flipped)
    assert (picture[128:132] == 255).all() and (picture[132:] == 0).all()  # the white gap, then the silent decode

    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mel.png").write_bytes(mel_picture(reference, decoded))
    Image.new("RGB", (240, 96), (200, 30, 30)).save(tmp_path / "clips" / "a.png")
    row = DecodedSample("clips/a.mp4", "clips", "x.pt", 20.0, 0.5, 9, "a.mp4", str(tmp_path / "clips" / "a.png"),
                        "clips/a", audio_mel_l1=1.25, mel_png=str(tmp_path / "clips" / "a.mel.png"))  # fmt: skip
    text = DecodeReport("out", "model", "meta:x", str(tmp_path), rows=[row]).artifact_markdown()
    assert "| psnr | ssim | frames | mel_l1 | per channel | sample |" in text and "· mel L1 1.2500**" in text
    strip, mel = _data_uris(text)
    assert strip.shape == (192, 480, 3) and mel.shape == (260, 20, 3)  # the strip enlarged ×2, the mel as it is
