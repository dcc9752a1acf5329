"""Family qwen-image in DiffSynth-Studio's split-training files, through the CLI (the qwen-image-diffsynth recipe):
the tuple its ``--task sft:data_process`` saves, compared with what its own released code makes (the ``diffsynth``
2.1.12 wheel: its QwenImagePipeline units, its QwenImageVAE and QwenImageTextEncoder with the same tiny weights, its
LoadImage and ImageCropAndResize) on the same images; check-consumer reads every file with its own UnifiedDataset.

Measured on the tiny snapshot in bf16: the pixels and the caption's rows (``prompt_emb``, ``prompt_emb_mask``) are
its own bit for bit; ``input_latents`` are within two bf16 steps of each of its own values (0.0117 at most): its
VAE's own bf16 arithmetic and its reciprocal of latents_std taken in float32 (latentforge's normalisation is musubi's
and diffusers': docs/qwen-image.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from infra.formats import get_format
from tests import diffsynth_ref
from tests import qwen_image_ref as ref
from tests.image_media import sample_images, write_folder

runner = CliRunner()
WIDTH, HEIGHT = 64, 48
BUILD = ["--recipe", "qwen-image-diffsynth", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "bf16"]
#: bf16's step at 1 (its machine epsilon): its own VAE's latents differ from these by at most 2 steps of each value.
STEP = 2**-7


@pytest.fixture(scope="module")
def images():
    return [image for image in sample_images() if image.mode in ("RGB", "RGBA", "L")]


@pytest.fixture(scope="module")
def built(images, qwen_image_model, tmp_path_factory) -> Path:
    src = write_folder(tmp_path_factory.mktemp("qd-src"), images)
    out = tmp_path_factory.mktemp("qd") / "cache"
    args = ["build", "--source", f"folder:{src}", "--model", str(qwen_image_model), "--out", str(out), *BUILD]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_each_file_is_what_its_own_data_process_saves(built, images, qwen_image_model):
    pipe = ref.diffsynth_pipeline(qwen_image_model)
    fmt = get_format("diffsynth", "qwen-image")
    steps = []
    for image in images:
        path = built / image.mode.lower() / "set-1" / f"{image.key}.pth"
        shared, posi, nega = torch.load(path, weights_only=True)
        theirs = ref.diffsynth_data_process(pipe, ref.diffsynth_image(image.data, HEIGHT, WIDTH), image.caption)
        kept = {k for k in theirs[0] if k not in ("input_image", "noise", "latents", "rand_device")}
        assert set(shared) - {"latentforge"} == kept
        for key in kept - {"input_latents"}:
            assert shared[key] == theirs[0][key], key
        assert shared["input_latents"].shape == theirs[0]["input_latents"].shape
        mine, its = shared["input_latents"].float(), theirs[0]["input_latents"].float()
        steps.append(float(((mine - its).abs() / (STEP * its.abs().clamp(min=1))).max()))  # in steps of the value
        for ours_side, their_side in ((posi, theirs[1]), (nega, theirs[2])):
            assert set(ours_side) == set(their_side)
            assert torch.equal(ours_side["prompt_emb"], their_side["prompt_emb"]), image.key
            assert torch.equal(ours_side["prompt_emb_mask"], their_side["prompt_emb_mask"]), image.key
        record = fmt.read(path)
        assert record["input_latents"].shape[1] == 1 and record["prompt_emb"].ndim == 2
    assert max(steps) <= 2, steps  # measured: 1.5 steps at most (0.0117 at |x| ≈ 1.5), docs/qwen-image.md


def test_check_consumer_reads_every_file_with_its_own_unified_dataset(built, images):
    diffsynth_ref.diffsynth()  # its wheel importable as ``diffsynth``
    assert any(Path(p).name.startswith("diffsynth-") for p in sys.path)
    result = runner.invoke(app, ["check-consumer", str(built)])
    assert result.exit_code == 0, result.output
    assert f"{len(images)} sample(s) read; one batch: input_latents 1×16×6×8, prompt_emb 1×" in result.output
