"""The wan21 family: the 16-channel Wan2.1 VAE with UMT5 (Wan2.1 T2V/I2V, Wan2.2 T2V/I2V-A14B), told from
model_index.json, its latents bit for bit the snapshot's own VAE normalised with its own config's statistics, its
image-to-video conditioning (``--mode i2v``) as the Wan trainers make it, and every refusal one line and exit 2.
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
from transformers import CLIPVisionModel
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.demo.tiny_wan21 import make_tiny_wan21
from infra.models import resolve_family
from infra.models.wan_constants import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD
from infra.plan import make_spec
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes

runner = CliRunner()
PROMPTS = ("Cyclists ride through city traffic past a grey van.", "A man in a suit talks in the back seat of a car.")
Z_DIM, SPATIAL = 16, 8
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


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


@torch.no_grad()
def test_i2v_stores_the_trainers_first_frame_conditioning(tmp_path, source, wan21_i2v_model):
    src, videos = source
    ok, result = run_build(config(src, wan21_i2v_model, tmp_path / "out", mode="i2v"))
    assert ok and result["done"] == 2, result
    vae = AutoencoderKLWan.from_pretrained(wan21_i2v_model / "vae", torch_dtype=torch.float32).eval()
    clip = CLIPVisionModel.from_pretrained(wan21_i2v_model / "image_encoder", torch_dtype=torch.float32).eval()
    latent_frames = 1 + (FRAMES - 1) // 4
    for index, video in enumerate(videos):
        stored, pixels = _sample_file(tmp_path / "out", index), _pixels(video)
        image_only = torch.cat([pixels[:, :, :1], torch.zeros_like(pixels[:, :, 1:])], dim=2)
        mask = torch.zeros(4, latent_frames, HEIGHT // SPATIAL, WIDTH // SPATIAL)
        mask[:, 0] = 1.0  # every channel of the first latent frame: it covers the conditioning frame only
        y = torch.cat([mask, _normalised(vae, image_only)]).to(torch.bfloat16)
        assert stored["image_latents"].dtype == torch.bfloat16 and torch.equal(stored["image_latents"], y)
        first = F.interpolate(pixels[:, :, 0], size=(224, 224), mode="bicubic", align_corners=False) * 0.5 + 0.5
        first = (first - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        features = clip(pixel_values=first, output_hidden_states=True).hidden_states[-2][0]
        assert list(stored["clip_features"].shape) == [257, 1280] and stored["clip_features"].dtype == torch.float16
        torch.testing.assert_close(stored["clip_features"].float(), features, atol=2e-3, rtol=2e-3)  # float16 steps
    spec = make_spec(config(src, wan21_i2v_model, tmp_path / "out", mode="i2v"))[1]
    t2v = make_spec(config(src, wan21_i2v_model, tmp_path / "out"))[1]
    assert spec.conditioning and t2v.conditioning is None and spec.fingerprint() != t2v.fingerprint()
    assert "conditioning" not in t2v.canonical()  # absent: a text-to-video cache keeps its fingerprint


def test_the_a14b_i2v_model_stores_y_without_clip_features(tmp_path, source):
    model = make_tiny_wan21(tmp_path / "i2v-a14b", variant="i2v-a14b")
    spec = make_spec(config(source[0], model, tmp_path / "out", mode="i2v"))[1]
    assert resolve_family(model, None).kinds(spec) == ("latents", "text_embeddings", "image_latents")
    assert "clip" not in str(spec.conditioning)


def test_the_ti2v_5b_model_stores_its_first_latent_frame(tmp_path, source, tiny_model):
    ok, result = run_build(config(source[0], tiny_model, tmp_path / "out", mode="i2v"))
    assert ok and result["done"] == 2, result
    for index in range(2):
        stored = _sample_file(tmp_path / "out", index)
        assert torch.equal(stored["first_frame_latents"], stored["x0"][:, :1])
        assert "image_latents" not in stored and "clip_features" not in stored


def _cli_build(src: Path, model: Path, out: Path, *extra: str):
    flags = ["build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--device", "cpu"]
    return runner.invoke(app, [*flags, "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), *extra])


@pytest.mark.parametrize(
    ("which", "extra", "said"),
    [
        ("wan21", ("--recipe", "wan22-vbvr"), "family wan22 is the Wan2.2-TI2V-5B VAE"),
        ("wan21", ("--family", "wan22"), "z_dim=16 is the Wan2.1 VAE"),
        ("wan22", ("--family", "wan21"), "z_dim=48 is not the Wan2.1 VAE"),
        ("wan21", ("--mode", "i2v"), "is a text-to-video Wan snapshot (WanPipeline)"),
    ],
    ids=["wan21-to-the-5b-recipe", "wan21-as-wan22", "5b-as-wan21", "i2v-of-a-t2v-model"],
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
