"""Video batching (``--video-batch``): batched latents within one bf16 step of batch one, the batch size in the
fingerprint, one sample's bytes the same whatever it is batched with, a damaged clip its own row, a failing batch
split one clip at a time; ``--vae-slicing`` gives batch one's bytes and fingerprint."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from infra.cache import ledger
from infra.config import ADDED_LATER, FINGERPRINT_NAMES, CacheSpec, fingerprint_of
from infra.models import load_family
from infra.plan import make_plan
from infra.preprocess.shard import process_shard
from infra.preprocess.vae_calls import encode_group
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip, faststart

CLIP_FRAMES = 20
NAMES = ("bikes", "carphone", "bigbuckbunny", "sample_1080p")
#: The largest difference batching may make to a stored (bf16) latent: one step at the latents' magnitude.
BF16_STEP = 2**-7
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def source(tmp_path_factory, clips):
    """One shard: four good clips, a damaged clip (packets cut at half) between them, one more good clip."""
    good = [cut_clip(clips[name], CLIP_FRAMES, width=160) for name in NAMES]
    whole = faststart(clips["carphone"])
    videos = [*good[:2], whole[: len(whole) // 2], *good[2:], good[0]]
    samples = [sample(0, i, video, f"prompt {i % 3}".encode()) for i, video in enumerate(videos)]
    return make_shards(tmp_path_factory.mktemp("vbatch") / "src", {"batch": samples})


def _latents(out):
    rows = ledger.read_shard(out, "batch")
    loaded = {k: torch.load(out / r.path, weights_only=True) for k, r in rows.items() if r.status == "done"}
    return rows, {k: v["x0"] for k, v in loaded.items()}


def _build(source, model, out, **options):
    plan = make_plan(config(source, model, out, **options))
    return plan.fingerprint, process_shard(plan.job, plan.shards[0])


def test_cli_video_batch_within_a_bf16_step_of_batch_one(tmp_path, tiny_model, source) -> None:
    args = ["build", "--source", f"vbvr:{source}", "--model", str(tiny_model), "--device", "cpu", "--dtype", "fp32"]
    args += ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--decode-samples", "0"]
    args += ["--on-loss", "accept", "--on-conflict", "abort", "--workers", "1"]
    for batch in (1, 3):
        done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / f"b{batch}"), "--video-batch", str(batch)])
        assert done.exit_code == 0, done.output
    one_rows, one = _latents(tmp_path / "b1")
    three_rows, three = _latents(tmp_path / "b3")
    assert {k: (r.status, r.reason) for k, r in three_rows.items()} == {
        k: (r.status, r.reason) for k, r in one_rows.items()
    }
    failed = [r for r in three_rows.values() if r.status != "done"]
    assert len(failed) == 1 and failed[0].id.endswith("00000002")  # the damaged clip: its own row
    assert len(three) == 5 and three.keys() == one.keys()
    for key, latents in three.items():
        assert latents.dtype == torch.bfloat16 and latents.shape == one[key].shape
        assert (latents.float() - one[key].float()).abs().max() <= BF16_STEP * max(1.0, one[key].abs().max())
    specs = [
        CacheSpec.model_validate(json.loads((tmp_path / f"b{b}" / "cache.json").read_text())["spec"]) for b in (1, 3)
    ]
    assert (specs[0].video_batch, specs[1].video_batch) == (1, 3)
    assert specs[1].fingerprint() != specs[0].fingerprint()
    data = specs[0].model_dump(mode="json")
    assert specs[0].fingerprint() == fingerprint_of(  # batch one: the fingerprint the cache had before the field
        {FINGERPRINT_NAMES.get(k, k): v for k, v in data.items() if k not in ADDED_LATER or v != ADDED_LATER[k]}
    )


def test_a_sample_has_the_same_bytes_whatever_it_is_batched_with(tmp_path, tiny_model, source) -> None:
    whole = tmp_path / "whole"
    _, result = _build(source, tiny_model, whole, video_batch=2)
    assert (result.vae_calls, result.vae_clips) == (3, 5)  # five clips in pairs, the last one padded
    part = tmp_path / "part"
    picked = sorted(ledger.read_shard(whole, "batch"))[3::2]  # two samples, batched apart from their neighbours
    _build(source, tiny_model, part, video_batch=2, only=[f"batch/{key}" for key in picked])
    _build(source, tiny_model, part, video_batch=2, on_conflict="reuse")  # the rest, in other batches
    _, expected = _latents(whole)
    _, got = _latents(part)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_vae_slicing_gives_batch_one_bytes_and_fingerprint(tmp_path, tiny_model, source) -> None:
    one, _ = _build(source, tiny_model, tmp_path / "one")
    sliced, _ = _build(source, tiny_model, tmp_path / "sliced", video_batch=3, vae_slicing=True)
    assert sliced == one
    _, a = _latents(tmp_path / "one")
    _, b = _latents(tmp_path / "sliced")
    assert b.keys() == a.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failing_batch_is_encoded_one_clip_at_a_time(tiny_model) -> None:
    encoder = load_family(tiny_model, "wan22", CPU, torch.float32)
    gen = torch.Generator().manual_seed(0)
    good = [torch.rand(1, 3, 5, 32, 32, generator=gen) * 2 - 1 for _ in range(2)]
    bad = torch.zeros(1, 4, 5, 32, 32)  # four channels: the VAE's first conv refuses it, alone or batched
    results = encode_group(encoder, [good[0], bad, good[1]], fixed=3)
    assert isinstance(results[1], RuntimeError)
    for clip, result in zip(good, (results[0], results[2]), strict=True):
        (alone,) = encode_group(encoder, [clip], fixed=3)
        assert isinstance(result, torch.Tensor) and torch.equal(result, alone)


@pytest.mark.parametrize("family", ["ltx2", "image-kl", "image-dc"])
def test_ltx2_and_image_batches_are_within_a_bf16_step_of_batch_one(tmp_path, ltx2_model, family) -> None:
    from infra.demo.tiny_image import make_tiny_image  # noqa: PLC0415

    if family == "ltx2":
        model, name, shape = ltx2_model, "ltx2", (1, 3, 9, 64, 64)
    else:
        model, name, shape = (
            make_tiny_image(tmp_path / family, vae=family[-2:], text="none"),
            "image",
            (1, 3, 1, 32, 32),
        )
    encoder = load_family(model, name, CPU, torch.float32)
    gen = torch.Generator().manual_seed(0)
    clips = [torch.rand(*shape, generator=gen) * 2 - 1 for _ in range(3)]
    batched = encode_group(encoder, clips, fixed=3)
    for clip, got in zip(clips, batched, strict=True):
        (alone,) = encode_group(encoder, [clip], fixed=1)
        assert isinstance(got, torch.Tensor) and got.shape == alone.shape
        assert (got.float() - alone.float()).abs().max() <= BF16_STEP * max(1.0, float(alone.abs().max()))
