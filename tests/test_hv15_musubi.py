"""``--recipe hv15-musubi``: musubi-tuner's HunyuanVideo 1.5 cache (architecture code ``hv15``), built, resumed,
verified and decoded through the CLI from a ``folder:`` source of real clips, and read back by musubi's loader rules
(`tests.musubi_reader`, ``architecture="hv15"``); what that loader hands its trainer is compared with musubi's caching
arithmetic restated here from kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7
(``hv_1_5_cache_latents.py``, ``hv_1_5_cache_text_encoder_outputs.py``,
``hunyuan_video_1_5/hunyuan_video_1_5_text_encoder.py``, ``hunyuan_video_1_5/hunyuan_video_1_5_vae.py``), on the same
clips with the same tiny weights. (bench/hv15_musubi_parity.py runs musubi's own code, given a checkout.)"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo15
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen2_5_VLTextModel, SiglipImageProcessor, SiglipVisionModel, T5EncoderModel
from typer.testing import CliRunner

from flows.cli import app
from infra.formats.musubi import TOML_NAME, flat_name
from infra.models import load_family
from infra.plan import make_spec
from infra.preprocess.prepare import prepare_video
from tests.conftest import config, tree_hashes
from tests.musubi_reader import BucketSelector, load_dataset_config

runner = CliRunner()
FRAMES, WIDTH, HEIGHT = 9, 64, 48
GEOMETRY = ["--recipe", "hv15-musubi", "--frames", str(FRAMES), "--width", str(WIDTH), "--height", str(HEIGHT)]
#: (clip, caption): straight and curly quotes with a repeat (musubi keeps it), and a caption with no quoted text.
CLIPS = (
    ("bikes", 'Cyclists pass a van whose sign says "STOP", then “停” and "STOP" again.'),
    ("carphone", "A man talks on the phone in a car."),
)
SOURCE_SIZES = {"bikes": (640, 272), "carphone": (176, 144)}
#: musubi's PROMPT_TEMPLATE_VIDEO, as its source holds it.
TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant. Describe the video by detailing the following aspects: \n1. The "
    "main content and theme of the video. \n2. The color, shape, size, texture, quantity, text, and spatial "
    "relationships of the objects. \n3. Actions, events, behaviors temporal relationships, physical movement changes "
    "of the objects. \n4. background environment, light, style and atmosphere. \n5. camera angles, movements, and "
    "transitions used in the video.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def _build(src: Path, model: Path, out: Path, *extra: str, dtype: str = "fp32"):
    flags = ["build", "--source", f"folder:{src}", "--model", str(model), "--out", str(out), "--device", "cpu"]
    return runner.invoke(app, [*flags, "--dtype", dtype, *GEOMETRY, "--decode-samples", "0", *extra])


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hv15-src")
    (root / "clips").mkdir()
    for name, caption in CLIPS:
        (root / "clips" / f"{name}.mp4").write_bytes(clips[name])
        (root / "clips" / f"{name}.txt").write_text(caption, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def cache(source, hv15_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hv15") / "cache"
    result = _build(source, hv15_model, out)
    assert result.exit_code == 0, result.output
    return out


def _bucket(name: str) -> tuple[int, int]:
    return BucketSelector((WIDTH, HEIGHT)).get_bucket_resolution(SOURCE_SIZES[name])


def test_the_files_have_musubis_hv15_names_keys_dtypes_and_metadata(cache):
    for name, caption in CLIPS:
        width, height = _bucket(name)
        stem = flat_name(f"clips/{name}")
        with safe_open(str(cache / f"{stem}_00000-009_{width:04d}x{height:04d}_hv15.safetensors"), "pt") as handle:
            assert set(handle.keys()) == {f"latents_3x{height // 16}x{width // 16}_bfloat16"}
            meta = {k: v for k, v in handle.metadata().items() if not k.startswith("latentforge_")}
        assert meta == {
            "architecture": "hunyuan_video_1_5",
            "width": str(width),
            "height": str(height),
            "frame_count": str(FRAMES),
            "format_version": "1.0.1",
        }
        with safe_open(str(cache / f"{stem}_hv15_te.safetensors"), "pt") as handle:
            assert set(handle.keys()) == {"varlen_vl_embed_bfloat16", "varlen_byt5_embed_float16"}
            assert handle.metadata()["caption1"] == caption
            assert handle.metadata()["architecture"] == "hunyuan_video_1_5"
    toml = (cache / TOML_NAME).read_text()
    assert f"resolution = [{WIDTH}, {HEIGHT}]" in toml and f"target_frames = [{FRAMES}]" in toml


def _musubi_latents(vae: AutoencoderKLHunyuanVideo15, frames: np.ndarray) -> torch.Tensor:
    """hv_1_5_cache_latents.encode_and_save_batch: uint8 (F,H,W,C) in the VAE's dtype → /127.5 - 1 → the posterior's
    mode under autocast in that dtype, unscaled."""
    contents = torch.from_numpy(frames)[None].permute(0, 4, 1, 2, 3).to(vae.dtype) / 127.5 - 1.0
    with torch.autocast("cpu", dtype=vae.dtype, enabled=vae.dtype != torch.float32):
        return vae.encode(contents, return_dict=False)[0].mode()[0]


def _musubi_vl(tokenizer, vlm: Qwen2_5_VLTextModel, caption: str) -> torch.Tensor:
    """get_qwen_tokens + get_qwen_prompt_embeds_from_tokens + the cache's ``embed_i[:vlm_len]``."""
    probe = tokenizer(TEMPLATE.format("a photo of a cat"), max_length=1024 + 256, padding=True, truncation=True)
    marker = tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    ids = probe.input_ids
    drop = next(i + len(marker) for i in range(len(ids) - len(marker) + 1) if ids[i : i + len(marker)] == marker)
    tokens = tokenizer(
        [TEMPLATE.format(caption)], max_length=1024 + drop, padding=True, truncation=True, return_tensors="pt"
    )
    hidden = vlm(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
    embeds, mask = hidden.hidden_states[-3][:, drop:], tokens.attention_mask[:, drop:]
    return embeds[0][: int(mask[0].bool().sum())]


def _musubi_glyph(tokenizer, byt5: T5EncoderModel, caption: str) -> torch.Tensor | None:
    """get_byt5_text_tokens + get_byt5_prompt_embeds_from_tokens + ``embed_byt5_list[i][:byt5_len]``; None: no
    glyph text (musubi stores zero rows)."""
    texts = re.findall(r"\"(.*?)\"", caption) + re.findall(r"“(.*?)”", caption)
    if not texts:
        return None
    glyph = "".join(f'Text "{text}". ' for text in texts)
    tokens = tokenizer(glyph, padding="max_length", max_length=128, truncation=True, return_tensors="pt")
    with torch.autocast("cpu", dtype=torch.float16):
        out = byt5(tokens.input_ids, attention_mask=tokens.attention_mask.float())[0]
    return out[0][: int(tokens.attention_mask.bool().sum())]


@torch.no_grad()
def test_musubis_loader_hands_its_trainer_musubis_own_tensors(cache, source, hv15_model, clips):
    (dataset,) = load_dataset_config(cache / TOML_NAME, architecture="hv15", batch_size=2)
    keys = {flat_name(f"clips/{name}"): (name, caption) for name, caption in CLIPS}
    assert sorted(item.item_key for item in dataset.items) == sorted(keys)
    for item in dataset.items:
        assert item.bucket == (*item.image_size, FRAMES) == (*_bucket(keys[item.item_key][0]), FRAMES)
    cfg = config(source, hv15_model, cache, frames=FRAMES, width=WIDTH, height=HEIGHT, recipe="hv15-musubi")
    spec = make_spec(cfg.model_copy(update={"source": f"folder:{source}"}))[1]
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(hv15_model / "vae").eval()
    vlm = Qwen2_5_VLTextModel.from_pretrained(hv15_model / "text_encoder").eval()
    tokenizer = AutoTokenizer.from_pretrained(hv15_model / "tokenizer")
    byt5 = T5EncoderModel.from_pretrained(hv15_model / "text_encoder_2", torch_dtype=torch.float16).eval()
    byt5_tokenizer = AutoTokenizer.from_pretrained(hv15_model / "tokenizer_2")
    seen = 0
    for index in range(len(dataset)):
        reso, batch = dataset.batches[index]
        data = dataset[index]
        for i, item in enumerate(dataset.buckets[reso][batch * 2 : batch * 2 + 2]):
            name, caption = keys[item.item_key]
            pixels = prepare_video(clips[name], spec).pixels[0]  # musubi's resize_image_to_bucket (test_resize_parity)
            frames = ((pixels.permute(1, 2, 3, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
            latents = _musubi_latents(vae, frames)
            assert data["latents"][i].dtype == torch.bfloat16 and data["latents"][i].shape == latents.shape
            assert torch.equal(data["latents"][i], latents.to(torch.bfloat16))
            vl = _musubi_vl(tokenizer, vlm, caption)
            assert data["vl_embed"][i].dtype == torch.bfloat16 and torch.equal(
                data["vl_embed"][i], vl.to(torch.bfloat16)
            )
            glyph = _musubi_glyph(byt5_tokenizer, byt5, caption)
            stored = data["byt5_embed"][i]
            if glyph is None:
                assert stored.shape == (0, byt5.config.d_model)
            else:
                assert stored.dtype == torch.float16 and torch.equal(stored, glyph.to(torch.float16))
            seen += 1
    assert seen == len(CLIPS)


def test_verify_inspect_decode_and_a_resume_through_the_cli(cache, source, hv15_model, tmp_path):
    verified = runner.invoke(app, ["verify", str(cache)])
    assert verified.exit_code == 0 and "COMPATIBLE" in verified.output, verified.output
    inspected = runner.invoke(app, ["inspect", str(cache)])
    assert inspected.exit_code == 0 and "hv_1_5_train_network" in inspected.output, inspected.output
    report = tmp_path / "decode"
    decoded = runner.invoke(app, ["decode", str(cache), "--decode-samples", "2", "--device", "cpu"])
    assert decoded.exit_code == 0 and "2 sample" in decoded.output, decoded.output
    before = tree_hashes(cache)
    again = _build(source, hv15_model, cache)
    assert again.exit_code == 0 and "0 encoded now, 2 reused" in again.output, again.output
    data = {k: v for k, v in tree_hashes(cache).items() if k.endswith((".safetensors", ".toml"))}
    assert data == {k: v for k, v in before.items() if k.endswith((".safetensors", ".toml"))}
    assert not report.exists()


def test_a_rerun_after_a_crash_keeps_the_files_it_left_with_the_same_bytes(cache, source, hv15_model, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(cache, out)
    data = {k: v for k, v in tree_hashes(out).items() if k.endswith(".safetensors")}
    (sealed,) = (out / "ledger").glob("*-00000.jsonl")
    sealed.unlink()  # its files written, its ledger never sealed: a crash
    again = _build(source, hv15_model, out)
    assert again.exit_code == 0 and "2 encoded now" in again.output, again.output
    assert {k: v for k, v in tree_hashes(out).items() if k.endswith(".safetensors")} == data  # the same bytes


@torch.no_grad()
def test_vae_tiling_is_musubis_128_pixel_tiles(hv15_model):
    """``--vae-tiling`` (the recipe's) is hv_1_5_cache_latents.py's default ``--vae_sample_size 128``: its
    AutoencoderKLConv3D.spatial_tiled_encode, restated: 128-pixel tiles every 96, latent rows blended over 2."""
    family = load_family(hv15_model, "hv15", torch.device("cpu"), torch.float32)
    tiled = load_family(hv15_model, "hv15", torch.device("cpu"), torch.float32, _tiling())
    x = torch.linspace(-1, 1, 3 * 144 * 176).reshape(1, 3, 1, 144, 176).mul(40).sin()  # one frame: tiles are spatial
    vae = family.vae
    rows = [[vae.encoder(x[..., i : i + 128, j : j + 128]) for j in range(0, 176, 96)] for i in range(0, 144, 96)]
    out_rows = []
    for i, row in enumerate(rows):
        kept = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend(rows[i - 1][j], tile, 2, -2)
            if j > 0:
                tile = _blend(row[j - 1], tile, 2, -1)
            kept.append(tile[..., :6, :6])
        out_rows.append(torch.cat(kept, dim=-1))
    moments = torch.cat(out_rows, dim=-2)
    musubi = moments[:, :32][0]  # DiagonalGaussianDistribution.mode(): the mean half of the moments
    assert torch.equal(tiled.encode_video(x), musubi)
    assert not torch.equal(family.encode_video(x), musubi)


def _blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    extent = min(a.shape[dim], b.shape[dim], extent)
    for k in range(extent):
        at = [slice(None)] * b.ndim
        at[dim] = k
        src = [slice(None)] * a.ndim
        src[dim] = -extent + k
        b[tuple(at)] = a[tuple(src)] * (1 - k / extent) + b[tuple(at)] * (k / extent)
    return b


def _tiling():
    from infra.models.memory import LoadOptions  # noqa: PLC0415

    return LoadOptions(vae_tiling=True)


#: musubi's frame_pack/framepack_utils.py FEATURE_EXTRACTOR_CONFIG (the SigLIP processor its --i2v caching builds).
SIGLIP_PROCESSOR = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 384, "width": 384},
}


@torch.no_grad()
def test_i2v_stores_musubis_latents_image_and_siglip(source, hv15_i2v_model, clips, tmp_path):
    """``--mode i2v`` is musubi's ``--i2v``: the first frame alone through the VAE in latent frame 0 of zeros, then a
    mask channel; SigLIP's last_hidden_state of the first uint8 frame (its fixed processor, the encoder in float16).
    A bf16 build: the VAE in bf16 under bf16 autocast, as musubi's ``--vae_dtype bfloat16``."""
    result = _build(source, hv15_i2v_model, tmp_path / "out", "--mode", "i2v", dtype="bf16")
    assert result.exit_code == 0, result.output
    (dataset,) = load_dataset_config(tmp_path / "out" / TOML_NAME, architecture="hv15")
    geometry = {"frames": FRAMES, "width": WIDTH, "height": HEIGHT, "recipe": "hv15-musubi"}
    cfg = config(source, hv15_i2v_model, tmp_path / "x", **geometry)
    spec = make_spec(cfg.model_copy(update={"source": f"folder:{source}"}))[1]
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(hv15_i2v_model / "vae", torch_dtype=torch.bfloat16).eval()
    siglip = SiglipVisionModel.from_pretrained(hv15_i2v_model / "image_encoder", torch_dtype=torch.float16).eval()
    keys = {flat_name(f"clips/{name}"): name for name, _ in CLIPS}
    for index in range(len(dataset)):
        reso, batch = dataset.batches[index]
        (item,) = dataset.buckets[reso][batch : batch + 1]
        data = dataset[index]
        pixels = prepare_video(clips[keys[item.item_key]], spec).pixels[0]
        frames = ((pixels.permute(1, 2, 3, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
        latents = _musubi_latents(vae, frames)
        first = _musubi_latents(vae, frames[:1])
        image = torch.zeros((33, *latents.shape[1:]))
        image[:32, :1], image[32, :1] = first, 1.0
        assert data["latents"][0].dtype == torch.bfloat16 and torch.equal(data["latents"][0], latents)
        assert data["latents_image"][0].dtype == torch.bfloat16
        assert torch.equal(data["latents_image"][0], image.to(torch.bfloat16))
        inputs = SiglipImageProcessor(**SIGLIP_PROCESSOR).preprocess(images=frames[0], return_tensors="pt")
        features = siglip(pixel_values=inputs.pixel_values.to(torch.float16)).last_hidden_state[0]
        assert data["siglip"][0].dtype == torch.float16 and torch.equal(data["siglip"][0], features)


def _refused(result, said: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], result.output


def test_what_no_trainer_reads_is_one_line_exit_2_and_nothing_written(source, hv15_model, tmp_path):
    parquet = _build(source, hv15_model, tmp_path / "pq", "--format", "parquet")
    _refused(parquet, "FastVideo 0.2.1 trains no HunyuanVideo 1.5")
    raw = _build(source, hv15_model, tmp_path / "raw", "--text-padding", "raw")
    _refused(raw, "family hv15 encodes each prompt alone, unpadded")
    i2v = _build(source, hv15_model, tmp_path / "i2v", "--mode", "i2v")
    _refused(i2v, "is not a HunyuanVideo 1.5 image-to-video snapshot")
    wan = _build(source, hv15_model, tmp_path / "wan", "--family", "wan21")
    assert wan.exit_code == 2, wan.output
    assert not any((tmp_path / name).exists() for name in ("pq", "raw", "i2v", "wan"))


def test_the_snapshot_is_told_from_model_index_and_the_glyph_rule_is_musubis(hv15_model, hv15_i2v_model):
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts  # noqa: PLC0415

    from infra.models import resolve_family  # noqa: PLC0415
    from infra.models.hv15_text import glyph_text  # noqa: PLC0415

    assert resolve_family(hv15_model, None).name == resolve_family(hv15_i2v_model, None).name == "hv15"
    prompt = 'a "x" “y” "x"'
    assert glyph_text(prompt) == 'Text "x". Text "x". Text "y". '  # musubi: straight quotes first, repeats kept
    assert extract_glyph_texts(prompt) == 'Text "x". Text "y". '  # diffusers' pipeline: another rule
    assert glyph_text("no quotes here") is None and glyph_text("") is None


def test_make_tiny_model_writes_the_same_bytes_for_the_same_seed(hv15_i2v_model, tmp_path):
    made = runner.invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--family", "hv15", "--variant", "i2v"])
    assert made.exit_code == 0 and "tiny hv15 model written" in made.output, made.output
    assert tree_hashes(tmp_path / "m") == tree_hashes(hv15_i2v_model)
    assert {p.name for p in (tmp_path / "m").iterdir()} >= {"vae", "text_encoder", "text_encoder_2", "image_encoder"}
