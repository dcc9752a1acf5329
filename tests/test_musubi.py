"""``--format musubi``: musubi-tuner's Wan cache, read back with its loader's own rules (`tests.musubi_reader`, pinned
to the commit they were read at): every counted sample is one latent file paired with its text file, under musubi's
names, keys, dtypes and metadata, bucketed as its BucketSelector recomputes from the source's size so that a batch of
2 stacks; the gates read the layout; what it cannot take is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.cache import ledger
from infra.config import UploadConfig
from infra.formats.musubi import TOML_NAME, flat_name
from infra.models import load_family
from infra.models.base import TextSettings
from infra.plan import make_spec
from infra.preprocess.prepare import prepare_video
from infra.publish.base import parse_target
from infra.publish.manifest import build_manifest
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.musubi_reader import BucketSelector, load_dataset_config

runner = CliRunner()
GEOMETRY = {"recipe": "musubi-wan", "frames": 17, "width": 80, "height": 48}
#: (clip, caption): 640x272 and 1920x1080 share musubi's 80x48 bucket, 176x144 is 64x48; captions its tokenizer cleans
SAMPLES = (
    ("bikes", "Cyclists  ride past\n a grey van."),
    ("carphone", "A man talks &amp; smiles in a car."),
    ("sample_1080p", "A couple walks in a park."),
)
SOURCE_SIZES = {"bikes": (640, 272), "carphone": (176, 144), "sample_1080p": (1920, 1080)}


def _samples(clips: dict[str, bytes]) -> list:
    return [sample(i % 2, i, clips[name], caption.encode()) for i, (name, caption) in enumerate(SAMPLES)]


def _stem(index: int) -> str:
    item = sample(index % 2, index, None, None)
    return f"{item.generator}/{item.task}_{index:08d}"


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    made = _samples(clips)
    return make_shards(tmp_path_factory.mktemp("musubi-src"), {"shard-0": made[:2], "shard-1": made[2:]})


@pytest.fixture(scope="module")
def cache(source, wan21_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("musubi") / "cache"
    ok, result = run_build(config(source, wan21_model, out, **GEOMETRY))
    assert ok and result["done"] == 3, result
    return out


def _done(out: Path) -> list[ledger.LedgerRow]:
    return [row for rows in ledger.read_all(out).values() for row in rows.values() if row.status == "done"]


def test_the_files_have_musubis_names_keys_dtypes_and_metadata(cache):
    for index, (name, caption) in enumerate(SAMPLES):
        # named by the bucket its frames were resized to, as musubi's video caching names them (not the source's size)
        bucket_w, bucket_h = BucketSelector((80, 48)).get_bucket_resolution(SOURCE_SIZES[name])
        latents = cache / f"{flat_name(_stem(index))}_00000-017_{bucket_w:04d}x{bucket_h:04d}_wan.safetensors"
        with safe_open(str(latents), framework="pt") as handle:
            assert set(handle.keys()) == {f"latents_5x{bucket_h // 8}x{bucket_w // 8}_bfloat16"}
            meta = handle.metadata()
        assert {k: v for k, v in meta.items() if not k.startswith("latentforge_")} == {
            "architecture": "wan",
            "width": str(bucket_w),
            "height": str(bucket_h),
            "frame_count": "17",
            "format_version": "1.0.1",
        }
        with safe_open(str(cache / f"{flat_name(_stem(index))}_wan_te.safetensors"), framework="pt") as handle:
            assert set(handle.keys()) == {"varlen_t5_bfloat16"}
            assert handle.metadata()["caption1"] == caption and handle.metadata()["architecture"] == "wan"
    toml = (cache / TOML_NAME).read_text()
    assert "resolution = [80, 48]" in toml and "target_frames = [17]" in toml and "enable_bucket = true" in toml


def test_musubis_loader_reads_every_sample_with_its_text_in_stacked_batches(cache, source, wan21_model, clips):
    (dataset,) = load_dataset_config(cache / TOML_NAME, batch_size=2)
    stems = {flat_name(_stem(i)): i for i in range(len(SAMPLES))}
    assert (
        sorted(item.item_key for item in dataset.items)
        == sorted(stems)
        == sorted(flat_name(_stem(int(row.id.rpartition("_")[2]))) for row in _done(cache))
    )
    selector = BucketSelector((80, 48), enable_bucket=True)
    for item in dataset.items:  # each latent file pairs with its own text file; its name's size is its bucket
        assert Path(item.text_encoder_output_cache_path).name == f"{item.item_key}_wan_te.safetensors"
        assert item.bucket == (*selector.get_bucket_resolution(item.image_size), 17) == (*item.image_size, 17)
    assert sorted(len(items) for items in dataset.buckets.values()) == [1, 2]
    spec = make_spec(config(source, wan21_model, cache, **GEOMETRY))[1]
    family = load_family(wan21_model, "wan21", torch.device("cpu"), torch.float32)
    sizes = []
    for (reso, batch), index in zip(dataset.batches, range(len(dataset)), strict=True):
        data = dataset[index]  # torch.stack of the batch: one shape per bucket, as the selector recomputes it
        items = dataset.buckets[reso][batch * 2 : batch * 2 + 2]
        sizes.append(len(items))
        for i, item in enumerate(items):
            name, caption = SAMPLES[stems[item.item_key]]
            pixels = prepare_video(clips[name], spec).pixels
            assert data["latents"][i].dtype == torch.bfloat16
            assert data["latents"][i].shape[2:] == (reso[1] // 8, reso[0] // 8)
            assert torch.equal(data["latents"][i], family.encode_video(pixels))
            text = data["t5"][i]  # musubi's T5 keeps the prompt's rows: the caption cleaned as its tokenizer does
            embedding = family.encode_text(" ".join(caption.replace("&amp;", "&").split()), TextSettings(512))
            assert text.dtype == torch.bfloat16 and torch.equal(text, embedding.embeds[: embedding.seq_len])
    assert sorted(sizes) == [1, 2]  # two clips of one bucket in one batch


def test_verify_reconcile_inspect_decode_upload_and_a_resume_read_the_layout(tmp_path, cache, source, wan21_model):
    flags = ["--family", "wan21"]
    verified = runner.invoke(app, ["verify", str(cache), *flags])
    assert verified.exit_code == 0 and "COMPATIBLE" in verified.output, verified.output
    reconciled = runner.invoke(app, ["reconcile", str(cache)])
    assert reconciled.exit_code == 0, reconciled.output
    inspected = runner.invoke(app, ["inspect", str(cache)])
    assert inspected.exit_code == 0 and "kohya-ss/musubi-tuner" in inspected.output, inspected.output
    report = decode_and_verify(cache, n=3, device="cpu", report_dir=tmp_path / "decode")
    assert not report.problems and len(report.rows) == 3
    target = parse_target("s3://bucket/musubi")
    data = {f.path for f in build_manifest(cache, UploadConfig(to=target.url), target).by_role("data")}
    assert len(data) == 6 and {p.endswith("_wan_te.safetensors") for p in data} == {True, False}
    before = tree_hashes(cache)
    ok, result = run_build(config(source, wan21_model, cache, **GEOMETRY))
    assert ok and result["done"] == 3 and result["encoded"] == 0 and result["reused"] == 3, result
    assert {k: v for k, v in tree_hashes(cache).items() if not k.startswith("ledger")} == {
        k: v for k, v in before.items() if not k.startswith("ledger")
    }


def test_check_consumer_names_the_package_it_would_read_with(cache):
    result = runner.invoke(app, ["check-consumer", str(cache)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "musubi-tuner's reader (musubi_tuner) is not importable here" in result.output


def test_a_rerun_after_a_crash_keeps_the_files_it_left_with_the_same_bytes(tmp_path, cache, source, wan21_model):
    out = tmp_path / "out"
    shutil.copytree(cache, out)
    data = {k: v for k, v in tree_hashes(out).items() if k.endswith(".safetensors")}
    (ledger.ledger_dir(out) / "shard-1.jsonl").unlink()  # its files written, its ledger never sealed: a crash
    ok, result = run_build(config(source, wan21_model, out, **GEOMETRY))
    assert ok and (result["done"], result["encoded"], result["reused"]) == (3, 1, 2), result
    assert {k: v for k, v in tree_hashes(out).items() if k.endswith(".safetensors")} == data  # the same bytes


def test_a_one_frame_build_is_musubis_image_dataset(tmp_path, clips, wan21_model):
    src = make_shards(tmp_path / "src", {"shard-0": _samples(clips)[1:2]})
    ok, result = run_build(config(src, wan21_model, tmp_path / "out", **{**GEOMETRY, "frames": 1}))
    assert ok and result["done"] == 1, result
    assert (tmp_path / "out" / f"{flat_name(_stem(1))}_0176x0144_wan.safetensors").is_file()  # no frame range
    (dataset,) = load_dataset_config(tmp_path / "out" / TOML_NAME)
    assert not dataset.video and [item.item_key for item in dataset.items] == [flat_name(_stem(1))]
    assert dataset[0]["latents"].shape == (1, 16, 1, 6, 8)  # 176x144 → musubi's 64x48 bucket


@torch.no_grad()
def test_i2v_stores_latents_image_and_clip_under_musubis_keys(tmp_path, clips, wan21_i2v_model):
    src = make_shards(tmp_path / "src", {"shard-0": _samples(clips)[:2]})
    ok, result = run_build(config(src, wan21_i2v_model, tmp_path / "out", mode="i2v", **GEOMETRY))
    assert ok and result["done"] == 2, result
    (dataset,) = load_dataset_config(tmp_path / "out" / TOML_NAME)
    for index in range(len(dataset)):
        data = dataset[index]
        _, _, frames, h, w = data["latents"].shape
        assert data["latents_image"].shape == (1, 20, frames, h, w) and data["latents_image"].dtype == torch.bfloat16
        assert data["clip"].shape == (1, 257, 1280) and data["clip"].dtype == torch.float16
        assert torch.equal(data["latents_image"][0, :4, 0], torch.ones(4, h, w))  # the mask: the first frame only
        assert not data["latents_image"][0, :4, 1:].any()
    with safe_open(str(next((tmp_path / "out").glob("*_wan.safetensors"))), framework="pt") as handle:
        keys = set(handle.keys())
    assert "clip_bfloat16" in keys and any(k.startswith("latents_image_") and k.endswith("_bfloat16") for k in keys)


def _refused(result, said: str, out: Path, before: dict[str, str]) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], result.output
    assert tree_hashes(out) == before


def _cli(src: Path, model: Path, out: Path, *extra: str):
    flags = ["build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--device", "cpu"]
    geometry = ["--recipe", "musubi-wan", "--frames", "17", "--width", "80", "--height", "48"]
    return runner.invoke(app, [*flags, *geometry, "--decode-samples", "0", *extra])


def test_what_musubi_cannot_read_is_one_line_exit_2_and_nothing_written(tmp_path, cache, clips, tiny_model):
    other = make_shards(tmp_path / "other", {"shard-9": _samples(clips)[1:2]})
    _refused(_cli(other, tiny_model, tmp_path / "5b"), "family wan22: kohya-ss/musubi-tuner", tmp_path / "5b", {})
    shared = tmp_path / "shared"
    shutil.copytree(cache, shared)
    model = Path(json.loads((shared / "cache.json").read_text())["provenance"]["model_path"])
    before = tree_hashes(shared)
    _refused(_cli(other, model, shared), "is the musubi cache directory of another dataset", shared, before)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "clip_00000-017_0640x0272_wan.safetensors").write_bytes(b"musubi's own")
    _refused(_cli(other, model, foreign), "musubi cache files latentforge did not write", foreign, tree_hashes(foreign))
    _refused(_cli(other, model, tmp_path / "head", "--temporal", "span"), "use --temporal head", tmp_path / "head", {})


def test_a_bf16_run_feeds_the_vae_musubis_bf16_pixels(source, wan21_model, clips):
    """``--dtype bf16`` (musubi's default VAE dtype): the prepared pixels are its ``contents.to(bf16) / 127.5 - 1``."""
    spec = make_spec(config(source, wan21_model, source.parent / "bf16", **GEOMETRY, dtype="bf16"))[1]
    prepared = prepare_video(clips["bikes"], spec)
    as_fp32 = prepare_video(clips["bikes"], spec.model_copy(update={"dtype": "fp32"}))
    levels = ((as_fp32.pixels + 1) * 127.5).round()  # the uint8 values its resize made
    assert torch.equal(prepared.pixels, levels.to(torch.bfloat16).div(127.5).sub(1).float())
    assert not torch.equal(prepared.pixels, as_fp32.pixels)
