"""The wan21 family: the 16-channel Wan2.1 VAE with UMT5 (Wan2.1 T2V/I2V, Wan2.2 T2V/I2V-A14B), told from
model_index.json, its latents bit for bit the snapshot's own VAE normalised with its own config's statistics, and
every refusal one line and exit 2.
"""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from typer.testing import CliRunner

from flows.cli import app
from flows.run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.demo.tiny_wan21 import make_tiny_wan21
from infra.models import resolve_family
from infra.models.wan_constants import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes

runner = CliRunner()
PROMPTS = ("Cyclists ride through city traffic past a grey van.", "A man in a suit talks in the back seat of a car.")
Z_DIM, SPATIAL = 16, 8


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> tuple[Path, list[bytes]]:
    videos = [clips["bikes"], clips["carphone"]]
    pairs = enumerate(zip(videos, PROMPTS, strict=True))
    samples = [sample(i, i, video, prompt.encode()) for i, (video, prompt) in pairs]
    return make_shards(tmp_path_factory.mktemp("wan21-src"), {"shard-0": samples}), videos


def _pixels(video: bytes) -> torch.Tensor:
    """The default recipe's pixels, straight: every frame decoded, linspace picks, /127.5 - 1, bilinear."""
    with av.open(io.BytesIO(video)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    picked = np.linspace(0, len(frames) - 1, FRAMES).round().astype(int)
    x = torch.from_numpy(np.stack([frames[i] for i in picked])).float().permute(0, 3, 1, 2) / 127.5 - 1
    x = F.interpolate(x, size=(HEIGHT, WIDTH), mode="bilinear", align_corners=False)
    return x.permute(1, 0, 2, 3).unsqueeze(0)


@torch.no_grad()
def _normalised(vae: AutoencoderKLWan, pixels: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(WAN21_LATENTS_MEAN).view(1, Z_DIM, 1, 1, 1)
    std = torch.tensor(WAN21_LATENTS_STD).view(1, Z_DIM, 1, 1, 1)
    return ((vae.encode(pixels).latent_dist.mode() - mean) / std)[0]


def _sample_file(out: Path, index: int) -> dict:
    item = sample(index, index, None, None)
    return torch.load(out / item.generator / f"{item.task}_{index:08d}.pt", weights_only=True)


@pytest.mark.parametrize("variant", ["t2v", "i2v", "t2v-a14b", "i2v-a14b"])
def test_every_wan21_vae_snapshot_is_told_from_its_model_index(tmp_path, variant):
    model = make_tiny_wan21(tmp_path / variant, variant=variant)
    family = resolve_family(model, None)
    assert family.name == "wan21"
    assert family.latent_shape(model, FRAMES, HEIGHT, WIDTH) == (Z_DIM, 5, HEIGHT // SPATIAL, WIDTH // SPATIAL)
    clip = {"image_encoder", "image_processor"} <= set(family.components_in(model))
    assert clip == (variant == "i2v")  # the A14B image-to-video model has no image encoder


def test_the_ti2v_5b_snapshot_stays_wan22(tiny_model):
    assert resolve_family(tiny_model, None).name == "wan22"


def test_wan21_latents_are_the_snapshots_vae_normalised_by_its_own_config(tmp_path, source, wan21_model):
    src, videos = source
    ok, result = run_build(config(src, wan21_model, tmp_path / "out"))
    assert ok and result["done"] == 2, result
    vae = AutoencoderKLWan.from_pretrained(wan21_model / "vae", torch_dtype=torch.float32).eval()
    assert vae.config.latents_mean == list(WAN21_LATENTS_MEAN)  # the real Wan2.1 statistics, from its config
    for index, video in enumerate(videos):
        stored = _sample_file(tmp_path / "out", index)
        assert torch.equal(stored["x0"], _normalised(vae, _pixels(video)).to(torch.bfloat16))
        assert list(stored["x0"].shape) == [Z_DIM, 5, HEIGHT // SPATIAL, WIDTH // SPATIAL]
    report = decode_and_verify(tmp_path / "out", n=2, device="cpu", report_dir=tmp_path / "decode")
    assert not report.problems and len(report.rows) == 2
    assert all(row.psnr is not None for row in report.rows)


def _cli_build(src: Path, model: Path, out: Path, *extra: str):
    flags = ["build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--device", "cpu"]
    return runner.invoke(app, [*flags, "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), *extra])


@pytest.mark.parametrize(
    ("which", "extra", "said"),
    [
        ("wan21", ("--recipe", "wan22-vbvr"), "family wan22 is the Wan2.2-TI2V-5B VAE"),
        ("wan21", ("--family", "wan22"), "z_dim=16 is the Wan2.1 VAE"),
        ("wan22", ("--family", "wan21"), "z_dim=48 is not the Wan2.1 VAE"),
    ],
    ids=["wan21-to-the-5b-recipe", "wan21-as-wan22", "5b-as-wan21"],
)
def test_a_model_given_to_what_it_is_not_is_one_line_exit_2_nothing_written(
    tmp_path, source, tiny_model, wan21_model, which, extra, said
):
    model = {"wan21": wan21_model, "wan22": tiny_model}[which]
    result = _cli_build(source[0], model, tmp_path / "out", *extra)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], result.output
    assert tree_hashes(tmp_path / "out") == {}
