"""make-tiny-model --train-on: the tiny Wan2.2 VAE fitted to a source's clips reconstructs them (real clips, the
real AutoencoderKLWan, through the CLI), deterministically; refusals leave nothing behind."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from typer.testing import CliRunner

from flows.cli import app
from infra.audit.metrics import psnr
from infra.demo.vae_fit.train import FitSettings, fit_vae
from infra.media.resize import frames_to_pixels
from infra.media.video import sample_frames
from tests.conftest import make_shards, sample

logger = logging.getLogger(__name__)
runner = CliRunner()
FRAMES, SIZE, STEPS = 9, 64, 60
GEOMETRY = ["--frames", str(FRAMES), "--height", str(SIZE), "--width", str(SIZE)]
USABLE = ("bikes", "carphone", "sample_1080p")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, clips) -> Path:
    """Three real clips and one truncated file that cannot be decoded."""
    samples = [sample(0, i, clips[name], b"a clip") for i, name in enumerate(USABLE)]
    samples.append(sample(0, 3, clips["truncated_mkv"], b"broken"))
    return make_shards(tmp_path_factory.mktemp("fit") / "src", {"G-11_part-00000": samples})


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, source: Path) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("fitted") / "model"
    result = runner.invoke(
        app, ["make-tiny-model", str(out), "--train-on", f"vbvr:{source}", "--steps", str(STEPS), *GEOMETRY]
    )
    assert result.exit_code == 0, result.output
    return out, result.output


def _recipe_psnr(model: Path, video: bytes) -> float:
    """PSNR of a clip through the cache's path: encode, mode, normalise, store bf16, denormalise, decode."""
    vae = AutoencoderKLWan.from_pretrained(model / "vae", local_files_only=True).eval()
    x = frames_to_pixels(sample_frames(video, FRAMES).frames, SIZE, SIZE)
    c = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1)
    with torch.inference_mode():
        z = ((vae.encode(x).latent_dist.mode() - mean) / std).to(torch.bfloat16)
        y = vae.decode(z.float() * std + mean).sample.clamp(-1, 1)
    return psnr(x[0], y[0])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_fitted_vae_reconstructs_the_clips_it_was_fitted_to(fitted, tiny_model, clips):
    model, output = fitted
    assert "fitting the VAE to 3 clip(s)" in output and "(VAE fitted)" in output
    for name in USABLE:
        before, after = _recipe_psnr(tiny_model, clips[name]), _recipe_psnr(model, clips[name])
        logger.info("%s: %.2f dB random, %.2f dB fitted", name, before, after)
        assert after >= 18.0 and after >= before + 6.0, (name, before, after)


def test_only_the_vae_changes_and_the_snapshot_loads_as_the_real_layout(fitted, tiny_model):
    model, _ = fitted
    files = sorted(str(p.relative_to(model)) for p in model.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(tiny_model)) for p in tiny_model.rglob("*") if p.is_file())
    for rel in files:
        same = _sha(model / rel) == _sha(tiny_model / rel)
        assert same == (rel != "vae/diffusion_pytorch_model.safetensors"), rel
    assert AutoencoderKLWan.load_config(model / "vae") == AutoencoderKLWan.load_config(tiny_model / "vae")


def test_the_fit_is_deterministic(tiny_model, clips):
    pixels = [frames_to_pixels(sample_frames(clips[name], FRAMES).frames, SIZE, SIZE) for name in USABLE]
    weights = []
    for _ in range(2):
        vae = AutoencoderKLWan.from_pretrained(tiny_model / "vae", local_files_only=True)
        fit_vae(vae, pixels, FitSettings(steps=3))
        weights.append(vae.state_dict())
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["encoder.conv_in.weight"], _random_conv_in(tiny_model))


def _random_conv_in(model: Path) -> torch.Tensor:
    return AutoencoderKLWan.from_pretrained(model / "vae", local_files_only=True).state_dict()["encoder.conv_in.weight"]


def test_train_on_refusals_leave_nothing_behind(tmp_path, source, clips):
    ltx = runner.invoke(app, ["make-tiny-model", str(tmp_path / "l"), "--family", "ltx2", "--train-on", "vbvr:x"])
    assert ltx.exit_code == 2 and "Wan2.2" in ltx.output and not (tmp_path / "l").exists()
    broken = make_shards(tmp_path / "broken", {"G-11_part-00000": [sample(0, 0, clips["truncated_mkv"], b"x")]})
    none = runner.invoke(app, ["make-tiny-model", str(tmp_path / "n"), "--train-on", f"vbvr:{broken}", *GEOMETRY])
    assert none.exit_code == 2 and "no usable clip" in none.output and not (tmp_path / "n").exists()
    small = runner.invoke(
        app, ["make-tiny-model", str(tmp_path / "s"), "--train-on", f"vbvr:{source}", "--height", "40", "--width", "40"]
    )
    assert small.exit_code == 2 and "multiples of 16" in small.output and not (tmp_path / "s").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    taken = runner.invoke(app, ["make-tiny-model", str(tmp_path / "full"), "--train-on", f"vbvr:{source}", *GEOMETRY])
    assert taken.exit_code == 2 and "nothing is overwritten" in taken.output
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
