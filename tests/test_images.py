"""The image family end to end: real scikit-image images in every mode (RGB, L, RGBA, P, EXIF-rotated, WebP) from a
`wds:` tar and a `folder:` tree → build → pt cache → read back → decode-and-verify; the preprocessing numerics
against a reference computation; the AutoencoderKL / AutoencoderDC normalisation against diffusers' formula."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderDC, AutoencoderKL
from PIL import Image
from transformers import AutoTokenizer, T5EncoderModel
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.demo.tiny_image import FLUX_SHIFT, make_tiny_image
from infra.errors import ConfigError, InputError
from infra.media.image import load_rgb, prepare_image
from infra.models import load_family
from infra.models.base import TextSettings
from infra.plan import make_plan
from infra.preprocess.shard import process_shard
from infra.sources import Problem, open_source
from infra.sources.wds import expand_braces
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.image_media import StillImage, rotated_jpeg, sample_images, write_folder, write_wds

#: A small geometry the tiny VAEs (4x spatial compression) take, H ≠ W so a swapped axis shows.
HEIGHT, WIDTH = 32, 48
runner = CliRunner()


@pytest.fixture(scope="module")
def images() -> list[StillImage]:
    return sample_images()


@pytest.fixture(scope="module")
def kl_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("image-models") / "kl-clip"
    result = runner.invoke(app, ["make-tiny-model", str(out), "--family", "image", "--vae", "kl", "--text", "clip"])
    assert result.exit_code == 0, result.output
    return out


def _config(source: str, model: Path, out: Path, **overrides: object) -> object:
    values = {"source": source, "family": None, "height": HEIGHT, "width": WIDTH, "frames": 1, **overrides}
    return config(Path("-"), model, out, **values)


def _reference_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """An independent computation: float RGB → torch bicubic antialiased resize to cover → centre crop → [-1, 1]."""
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)[None]
    scale = max(width / image.width, height / image.height)
    size = (max(height, round(image.height * scale)), max(width, round(image.width * scale)))
    x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    return x[0, :, top : top + height, left : left + width].clamp(0, 255) / 127.5 - 1


def _alpha_over_white(rgba: np.ndarray) -> np.ndarray:
    rgb, alpha = rgba[..., :3].astype(np.float64), rgba[..., 3:].astype(np.float64) / 255
    return np.round(rgb * alpha + 255 * (1 - alpha)).astype(np.uint8)


def test_every_mode_becomes_upright_rgb_as_a_reference_computes_it(images):
    by_key = {image.key: image for image in images}
    decoded = {key: Image.open(io.BytesIO(image.data)) for key, image in by_key.items()}
    rgb = {key: np.asarray(load_rgb(image.data)) for key, image in by_key.items()}
    assert all(a.ndim == 3 and a.shape[2] == 3 and a.dtype == np.uint8 for a in rgb.values())
    camera = np.asarray(decoded["camera"])  # L: every channel the grey value
    assert decoded["camera"].mode == "L" and all(np.array_equal(rgb["camera"][..., c], camera) for c in range(3))
    logo = np.asarray(decoded["logo"])  # RGBA: over white, transparent pixels exactly white
    assert decoded["logo"].mode == "RGBA" and (logo[..., 3] == 0).any()
    assert np.abs(rgb["logo"].astype(int) - _alpha_over_white(logo)).max() <= 1
    assert (rgb["logo"][logo[..., 3] == 0] == 255).all()
    chelsea = decoded["chelsea"]  # P with a transparent index: that index white, the rest the palette's colours
    assert chelsea.mode == "P"
    index = np.asarray(chelsea)
    colours = np.asarray(chelsea.convert("RGB"))
    assert (rgb["chelsea"][index == 0] == 255).all() and (index == 0).any()
    assert np.array_equal(rgb["chelsea"][index != 0], colours[index != 0])
    stored = np.asarray(decoded["coffee"].convert("RGB"))  # EXIF 6: stored on its side, shown turned clockwise
    assert stored.shape[0] > stored.shape[1] and rgb["coffee"].shape[1] > rgb["coffee"].shape[0]
    assert np.array_equal(rgb["coffee"], np.rot90(stored, k=-1))
    for key, image in by_key.items():  # resize + crop + scaling against torch's antialiased bicubic
        pixels, clip = prepare_image(image.data, HEIGHT, WIDTH)
        assert pixels.shape == (1, 3, 1, HEIGHT, WIDTH) and pixels.dtype == torch.float32
        assert clip.source_shape == [1, *rgb[key].shape]
        reference = _reference_pixels(Image.fromarray(rgb[key]), HEIGHT, WIDTH)
        error = (pixels[0, :, 0] - reference).abs()
        assert error.mean() < 0.02 and error.max() < 0.25, (key, float(error.mean()), float(error.max()))


def test_a_video_or_a_broken_file_is_refused_with_a_reason(clips):
    for data in (clips["carphone"], b"\x89PNG\r\n\x1a\nnot really", b"plain text"):
        with pytest.raises(InputError) as caught:
            prepare_image(data, HEIGHT, WIDTH)
        assert caught.value.reason == "not_an_image"


@pytest.mark.parametrize(("vae", "text"), [("kl", "none"), ("dc", "t5")])
def test_latents_are_normalised_as_diffusers_pipelines_do(tmp_path, vae, text, images):
    model = make_tiny_image(tmp_path / vae, vae=vae, text=text, seed=3)
    family = load_family(model, "image", torch.device("cpu"), torch.float32)
    pixels, _ = prepare_image(images[0].data, HEIGHT, WIDTH)
    latents = family.encode_video(pixels)
    if vae == "kl":
        ref = AutoencoderKL.from_pretrained(model / "vae")
        assert ref.config.shift_factor == FLUX_SHIFT  # the shift is really exercised
        raw = ref.encode(pixels[:, :, 0]).latent_dist.mode()
        expected = (raw - ref.config.shift_factor) * ref.config.scaling_factor  # FluxImg2ImgPipeline._encode_vae_image
        image = ref.decode(latents[None] / ref.config.scaling_factor + ref.config.shift_factor).sample  # FluxPipeline
    else:
        ref = AutoencoderDC.from_pretrained(model / "vae")
        expected = ref.encode(pixels[:, :, 0]).latent * ref.config.scaling_factor  # Sana
        image = ref.decode(latents[None] / ref.config.scaling_factor).sample
    assert latents.shape == (expected.shape[1], HEIGHT // 4, WIDTH // 4)
    torch.testing.assert_close(latents, expected[0].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        family.decode(latents), image[0].detach().clamp(-1, 1).unsqueeze(1), rtol=1e-4, atol=1e-4
    )
    if text == "t5":  # the real T5 tokenizer and T5EncoderModel, padded to max_length, last_hidden_state as is
        caption = images[0].caption
        embedding = family.encode_text(caption, TextSettings(max_length=77))
        tokenizer = AutoTokenizer.from_pretrained(model / "tokenizer")
        encoder = T5EncoderModel.from_pretrained(model / "text_encoder")
        tokens = tokenizer([caption], padding="max_length", max_length=77, return_tensors="pt")
        expected_text = encoder(tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state[0]
        assert embedding.seq_len == len(tokenizer(caption).input_ids) == int(tokens.attention_mask.sum())
        torch.testing.assert_close(embedding.embeds, expected_text.detach(), rtol=1e-5, atol=1e-5)


def test_wds_source_streams_members_and_expands_braces(tmp_path, images):
    for i in range(3):
        write_wds(tmp_path / "wds" / f"{i:03d}.tar", images[i * 2 : i * 2 + 2])
    assert expand_braces("a/{000..002}.tar") == ["a/000.tar", "a/001.tar", "a/002.tar"]
    assert expand_braces("{x,y}-{1..2}") == ["x-1", "x-2", "y-1", "y-2"]
    braced = open_source(f"wds:{tmp_path}/wds/{{000..001}}.tar")
    assert [s.id for s in braced.shards()] == ["000", "001"]
    source = open_source(f"wds:{tmp_path / 'wds'}")
    shards = source.shards()
    assert [s.id for s in shards] == ["000", "001", "002"]
    refs = list(source.samples(shards[0]))
    assert [(r.group, r.id, r.stem) for r in refs] == [
        ("000", "astronaut", "000/astronaut"),
        ("000", "camera", "000/camera"),
    ]
    assert sorted(refs[0].identity.members) == ["astronaut.json", "astronaut.png", "astronaut.txt"]
    assert not refs[0].identity.read_sha256  # listing reads headers only
    evil = tmp_path / "evil" / "e.tar"  # a key that would leave OUT: a layout error, no output name
    write_wds(evil, [StillImage("../../evil", images[0].data, "x", "RGB")])
    (ref,) = open_source(f"wds:{evil}").samples(open_source(f"wds:{evil}").shards()[0])
    assert ref.stem == "" and "unsafe key" in ref.problems[Problem.BAD_LAYOUT]
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(f"wds:{tmp_path}/wds/{{000..004}}.tar").shards()


def test_wds_build_reads_back_resumes_without_reading_and_decodes(tmp_path, kl_clip, images, monkeypatch):
    src = write_wds(tmp_path / "src" / "shard-000.tar", [*images, StillImage("bad", b"\xff\xd8\xffjunk", "junk", "?")])
    with tarfile.open(src, "a") as tf:  # a caption without an image, and an image without a caption
        for name, data in (("lonely.txt", b"no image here"), ("nocap.png", images[0].data)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    ok, result = run_build(_config(f"wds:{src.parent}", kl_clip, out, decode_samples=2))
    assert ok, result
    rows = ledger.read_shard(out, "shard-000")
    status = {key: (row.status, row.reason) for key, row in rows.items()}
    assert status == {
        **{image.key: ("done", None) for image in images},
        "bad": ("skipped", "not_an_image"),
        "lonely": ("skipped", "missing_video"),
        "nocap": ("skipped", "missing_prompt"),
    }
    record = torch.load(out / "shard-000" / "coffee.pt", weights_only=True)
    assert record["x0"].shape == (4, HEIGHT // 4, WIDTH // 4) and record["x0"].dtype == torch.bfloat16
    assert record["text_embeds"].shape == (77, 32) and record["prompt"] == "Coffee cup."
    assert record["source_shape"] == [1, 64, 96, 3]  # upright (EXIF applied): 96 wide, 64 high
    assert rows["coffee"].source.read_sha256.keys() == {"coffee.jpg", "coffee.txt"}
    assert json.loads((out / "cache.json").read_text())["spec"]["family"] == "image"
    assert len(result["decode_strips"]) == 2 and all(Path(p).is_file() for p in result["decode_strips"])
    decoded = json.loads(next((out / "reports" / "decode").rglob("report.json")).read_text())
    assert len(decoded["rows"]) == 2 and decoded["problems"] == []  # the tiny random VAE: numbers, no PSNR gate
    assert all(np.isfinite(row["psnr"]) for row in decoded["rows"])
    reads: list[str] = []  # a second run: every sample done, not one member read
    original = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda tf, m: reads.append(str(m)) or original(tf, m))
    plan = make_plan(_config(f"wds:{src.parent}", kl_clip, out))
    process_shard(plan.job, plan.shards[0])
    assert reads == [m for m in reads if "bad" in m or "lonely" in m or "nocap" in m]  # only the skipped, again


def test_folder_build_fp16_without_text_encoder(tmp_path, images, clips):
    model = make_tiny_image(tmp_path / "dc-none", vae="dc", text="none")
    src = write_folder(tmp_path / "photos", images)
    (src / "rgb" / "set-1" / "clip.mp4").write_bytes(clips["carphone"])  # a video given to the image family
    (src / "rgb" / "set-1" / "clip.txt").write_text("a man on the phone")
    (src / "top.png").write_bytes(images[0].data)
    (src / "top.txt").write_text("at the top")
    out = tmp_path / "out"
    ok, result = run_build(_config(f"folder:{src}", model, out, store_dtype="fp16", decode_samples=1))
    assert ok, result
    recon = json.loads(Path(result["run_report"]).read_text())["reconciliation"]
    assert recon["kinds"] == ["latents"] and recon["produced"] == len(images) + 1 and recon["shortfall"] == 1
    assert len(result["decode_strips"]) == 1
    rows = ledger.read_shard(out, "photos-00000")
    assert rows["rgb/set-1/clip.mp4"].reason == "not_an_image"
    assert rows["exif/set-1/coffee.jpg"].group == "exif" and rows["top.png"].group == ""
    done = [r for r in rows.values() if r.status == "done"]
    assert len(done) == len(images) + 1
    record = torch.load(out / "exif" / "set-1" / "coffee.pt", weights_only=True)
    assert record["x0"].dtype == torch.float16 and record["x0"].shape == (8, HEIGHT // 4, WIDTH // 4)
    assert "text_embeds" not in record and record["prompt"] == "Coffee cup."
    assert (out / "top.pt").is_file()
    spec = json.loads((out / "cache.json").read_text())["spec"]
    assert spec["store_dtype"] == "fp16" and spec["frames"] == 1 and "text_encoder" not in spec["model_identity"]


def test_image_family_refuses_what_it_cannot_do(tmp_path, kl_clip, images):
    src = write_wds(tmp_path / "src" / "s.tar", images[:1])
    for overrides, named in (
        ({"resize": "stretch"}, "--resize stretch"),
        ({"height": 30}, "multiple of 4"),
        ({"audio": True}, "no audio encoder"),
    ):
        with pytest.raises(ConfigError, match=named):
            make_plan(_config(f"wds:{src.parent}", kl_clip, tmp_path / "out", **overrides))


def test_fp16_is_refused_for_video_families(tmp_path, tiny_model):
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, b"x", b"p")]})
    with pytest.raises(ConfigError, match="--store-dtype fp16: family wan22 stores bf16"):
        make_plan(config(src, tiny_model, tmp_path / "out", store_dtype="fp16"))


def test_the_image_recipe_plans_an_image_cache(tmp_path, kl_clip, images):
    src = write_wds(tmp_path / "src" / "s.tar", images[:1])
    values = {"source": f"wds:{src.parent}", "recipe": "image-512", "height": HEIGHT, "width": WIDTH}
    plan = make_plan(config(Path("-"), kl_clip, tmp_path / "out", **values))  # frames: the fixture's 17, ignored
    assert (plan.spec.family, plan.spec.frames, plan.spec.store_dtype) == ("image", 1, "bf16")
    assert plan.job.latent_shape == (4, HEIGHT // 4, WIDTH // 4) and plan.job.kinds == ("latents", "text_embeddings")
    assert Image.open(io.BytesIO(rotated_jpeg())).getexif()[0x0112] == 6


def test_tiny_image_models_are_byte_identical_per_seed(tmp_path):
    first, second = (make_tiny_image(tmp_path / name, vae="dc", text="none", seed=5) for name in ("a", "b"))
    other = make_tiny_image(tmp_path / "c", vae="dc", text="none", seed=6)
    assert tree_hashes(first) == tree_hashes(second) != tree_hashes(other)
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "d"), "--family", "image", "--vae", "vq"])
    assert result.exit_code == 2 and "--vae kl|dc" in result.output
