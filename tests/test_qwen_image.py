"""Family qwen-image in musubi-tuner's ``qi`` cache, through the CLI: a build of real images (every mode the image
sources take) with the qwen-image-musubi recipe, its resume, verify and decode-and-verify, the files under musubi's
names, keys, dtypes and metadata, read by its loader's own rules (its BucketSelector from the names, a batch per
bucket), and every tensor equal, bit for bit, to musubi's own caching restated at its pinned commit
(`tests.qwen_image_ref`) on the same images with the same tiny weights. Also: the drop index is the real template's
prefix in the real tokenizer; the Edit snapshot is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows.cli import app
from infra.models.qwen_image import DROP_INDEX, TEMPLATE
from tests import qwen_image_ref as ref
from tests.image_media import sample_images, suffix, write_folder
from tests.musubi_reader import MusubiDataset

runner = CliRunner()
WIDTH, HEIGHT = 64, 48  # musubi's resolution: buckets of 16 around 64x48 (the 96-px images shrink, 64-px ones too)
BUILD = ["--recipe", "qwen-image-musubi", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "bf16"]


@pytest.fixture(scope="module")
def images():
    return sample_images()


@pytest.fixture(scope="module")
def built(images, qwen_image_model, tmp_path_factory) -> tuple[Path, Path]:
    src = write_folder(tmp_path_factory.mktemp("qi-src"), images)
    out = tmp_path_factory.mktemp("qi") / "cache"
    args = ["build", "--source", f"folder:{src}", "--model", str(qwen_image_model), "--out", str(out), *BUILD]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return src, out


def _stem(image) -> str:
    return f"{image.mode.lower()}%2Fset-1%2F{image.key}"


def test_the_drop_index_is_the_templates_prefix_in_the_real_tokenizer(qwen_image_model):
    """Qwen-Image's 34: the system prompt and ``<|im_start|>user\\n`` tokenize to 34 tokens with the real Qwen2.5
    tokenizer, so the rows kept start at the caption's first token."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy

    tokenizer = AutoTokenizer.from_pretrained(qwen_image_model / "tokenizer")
    prefix = tokenizer(TEMPLATE.split("{}")[0]).input_ids
    whole = tokenizer(TEMPLATE.format("Chelsea the cat.")).input_ids
    assert len(prefix) == DROP_INDEX and whole[:DROP_INDEX] == prefix
    assert tokenizer.convert_ids_to_tokens(whole[DROP_INDEX:])[:3] == ["Chelsea", "Ġthe", "Ġcat"]


def test_musubis_names_keys_dtypes_metadata_and_dataset_config(built, images):
    src, out = built
    for image in images:
        width, height = _size(src, image)
        latents = out / f"{_stem(image)}_{width:04d}x{height:04d}_qi.safetensors"
        with safe_open(str(latents), framework="pt") as handle:
            (key,) = handle.keys()
            meta = handle.metadata()
        assert key.startswith("latents_1x") and key.endswith("_bfloat16")
        assert {k: v for k, v in meta.items() if not k.startswith("latentforge_")} == {
            "architecture": "qwen_image", "width": str(width), "height": str(height), "format_version": "1.0.1"
        }  # fmt: skip
        text = out / f"{_stem(image)}_qi_te.safetensors"
        with safe_open(str(text), framework="pt") as handle:
            assert list(handle.keys()) == ["varlen_vl_embed_bfloat16"]
            assert handle.metadata()["caption1"] == image.caption
            assert handle.metadata()["architecture"] == "qwen_image"
    toml = (out / "musubi_dataset.toml").read_text()
    assert "image_directory" in toml and f"resolution = [{WIDTH}, {HEIGHT}]" in toml


def _size(src: Path, image) -> tuple[int, int]:
    """The stored (width, height) of a source image."""
    from PIL import Image  # noqa: PLC0415

    return Image.open(src / image.mode.lower() / "set-1" / f"{image.key}.{suffix(image.data)}").size


def test_musubis_loader_buckets_and_batches_every_image(built, images):
    """Its prepare_for_training from the names (a qi image's bucket: (W, H)), batches of 2 per bucket stack."""
    _, out = built
    params = {"cache_directory": str(out), "resolution": [WIDTH, HEIGHT], "enable_bucket": True, "batch_size": 2}
    dataset = MusubiDataset(params, "qi")
    assert sum(len(items) for items in dataset.buckets.values()) == len(images)
    assert all(len(bucket) == 2 for bucket in dataset.buckets)
    stacked = 0
    for index in range(len(dataset)):
        batch = dataset[index]
        assert batch["latents"].dtype == torch.bfloat16 and batch["latents"].shape[2] == 1
        assert all(t.ndim == 2 and t.shape[1] == 32 for t in batch["vl_embed"])
        stacked = max(stacked, batch["latents"].shape[0])
    assert stacked == 2


def test_every_tensor_is_musubis_own_caching_bit_for_bit(built, images, qwen_image_model):
    """Latents: its Image.open, bucket, resize_image_to_bucket, float32 scaling, the VAE in bf16 and its
    normalisation in bf16; text: its get_qwen_prompt_embeds with the VLM cast to bf16, trimmed to the mask."""
    from diffusers import AutoencoderKLQwenImage  # noqa: PLC0415 - heavy
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration  # noqa: PLC0415

    _, out = built
    vae = AutoencoderKLQwenImage.from_pretrained(qwen_image_model / "vae", torch_dtype=torch.bfloat16).eval()
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_image_model / "text_encoder")
    vlm = vlm.to(torch.bfloat16).eval()  # its load_qwen2_5_vl: the model cast to the dtype, buffers too
    tokenizer = AutoTokenizer.from_pretrained(qwen_image_model / "tokenizer")
    for image in images:
        contents, (bw, bh) = ref.musubi_pixels(image.data, (WIDTH, HEIGHT))
        (latent_file,) = out.glob(f"{_stem(image)}_*_qi.safetensors")
        (ours,) = load_file(latent_file).values()
        assert torch.equal(ours, ref.musubi_latents(vae, contents)), image.key
        assert ours.shape == (16, 1, bh // 8, bw // 8)
        (text,) = load_file(out / f"{_stem(image)}_qi_te.safetensors").values()
        assert torch.equal(text, ref.musubi_text(tokenizer, vlm, image.caption)), image.key


def test_resume_verify_and_decode_through_the_cli(built, qwen_image_model):
    src, out = built
    before = {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    args = ["build", "--source", f"folder:{src}", "--model", str(qwen_image_model), "--out", str(out), *BUILD]
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "0 encoded now" in again.output or "6 reused" in again.output, again.output
    assert {p.name: p.read_bytes() for p in out.glob("*.safetensors")} == before
    verify = runner.invoke(app, ["verify", str(out)])
    assert verify.exit_code == 0 and "COMPATIBLE" in verify.output, verify.output
    decoded = runner.invoke(app, ["decode", str(out), "--decode-samples", "2", "--min-psnr", "0"])
    assert decoded.exit_code == 0 and "PSNR" in decoded.output, decoded.output


def test_the_edit_snapshot_is_refused_in_one_line(qwen_image_model, tmp_path):
    import shutil  # noqa: PLC0415

    edit = tmp_path / "edit"
    shutil.copytree(qwen_image_model, edit)
    index = json.loads((edit / "model_index.json").read_text()) | {"_class_name": "QwenImageEditPipeline"}
    (edit / "model_index.json").write_text(json.dumps(index))
    src, out = tmp_path / "src", tmp_path / "o"
    src.mkdir()
    (src / "a.png").write_bytes(sample_images()[0].data)
    (src / "a.txt").write_text("a")
    args = [
        "build",
        "--source",
        f"folder:{src}",
        "--model",
        str(edit),
        "--out",
        str(out),
        *BUILD,
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "Qwen-Image-Edit" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()
