"""Consumer parity: what FastVideo's own released collate (0.2.1, loaded from its wheel: `tests.fastvideo_ref`)
hands its trainer from a latentforge parquet cache equals what FastVideo's own preprocessing would have stored,
computed here by a straight-line copy of that preprocessing's steps, within one bf16 step (latentforge stores
bf16 values; FastVideo's reader widens them to float32).

* Wan2.2: the raw posterior ``mean`` (FastVideo's WanModel normalises at training time) and UMT5's
  ``last_hidden_state`` trimmed to the prompt's tokens (the collate pads it back with zeros and a mask);
* LTX-2: the VAE mean normalised as ltx-core's VAE returns it, and the post-connector text with all 1024 rows (the
  connectors' registers fill the padding; the collate's mask is all ones); ``fps`` the rate the frames were
  resampled to (it feeds LTX2Model's RoPE) and ``duration_sec`` their length.

The pixels fed to the VAE are the recipe's, made here the way each preprocessing makes them (decode, pick the
frames, resize): the geometry is chosen so that no rounding of a resized side is involved (160×68 → 160×64 for
LTX-2 is a crop only).
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flows.terminal_run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.audit.inspect import format_report, inspect_cache
from infra.errors import ConfigError
from infra.formats.consumers import RAW_MEAN
from infra.formats.stream import stream_samples
from infra.plan import make_spec
from tests.conftest import config, make_shards, sample
from tests.fastvideo_ref import fastvideo_collate
from tests.media_utils import cut_clip

PROMPTS = ("a cyclist rides past parked cars", "a man talks on the phone in a car")
WAN = {"frames": 17, "height": 48, "width": 80}
LTX2 = {"frames": 9, "height": 64, "width": 160}
TRAIN_FPS = 24.0
WAN_TEXT_LEN, LTX2_TEXT_LEN = 512, 1024


@pytest.fixture(scope="module")
def collate():
    return fastvideo_collate()


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """Two real clips (25 fps, 20 frames, 160 wide), one per shard, keyed by the sample id the cache gives them."""
    videos = [cut_clip(clips[name], 20, width=160) for name in ("bikes", "carphone")]
    shards = {f"shard-{i}": [sample(0, i, videos[i], PROMPTS[i].encode())] for i in range(2)}
    root = make_shards(tmp_path_factory.mktemp("parity-src"), shards)
    return root, dict(zip(PROMPTS, videos, strict=True))


@pytest.fixture(scope="module")
def wan_caches(source, tiny_model, tmp_path_factory) -> dict[str, Path]:
    """The same two clips as a Wan2.2 parquet cache (FastVideo's raw mean) and a pt cache (normalised)."""
    root = tmp_path_factory.mktemp("parity-wan")
    return {fmt: _build(config(source[0], tiny_model, root / fmt, format=fmt, **WAN)) for fmt in ("parquet", "pt")}


def _build(cfg) -> Path:
    ok, result = run_build(cfg)
    assert ok and result["done"] == 2, result
    return Path(cfg.out)


def _collated(collate, out: Path, text_len: int) -> dict:
    """Every row of the cache's parquet parts through FastVideo's own collate."""
    tables = [pq.read_table(p) for p in sorted((out / "shards").glob("*.parquet"))]
    rows = [row for table in tables for row in table.to_pylist()]
    return collate.collate_rows_from_parquet_schema(rows, tables[0].schema, text_len)


def _bf16_step(reference: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each value (8 significant bits), at least the smallest normal's."""
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(exponent - 7)


def assert_within_bf16_step(got: torch.Tensor, reference: torch.Tensor) -> None:
    assert got.shape == reference.shape and got.dtype == torch.float32
    off = (got - reference).abs() > _bf16_step(reference)
    assert not bool(off.any()), f"{int(off.sum())} of {off.numel()} values differ by more than one bf16 step"


def _decoded(video: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(video)) as container:
        stream = container.streams.video[0]
        native = float(stream.average_rate or Fraction(24))
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return frames, native


def _wan_pixels(video: bytes) -> torch.Tensor:
    """The Wan recipe's frames: F spread over the clip, /127.5 - 1, bilinear (align_corners False) to H×W."""
    frames, _ = _decoded(video)
    picked = np.linspace(0, len(frames) - 1, WAN["frames"]).round().astype(np.int64)
    x = torch.from_numpy(frames[picked]).float().permute(0, 3, 1, 2) / 127.5 - 1.0
    x = F.interpolate(x, size=(WAN["height"], WAN["width"]), mode="bilinear", align_corners=False)
    return x.permute(1, 0, 2, 3).unsqueeze(0)


def _fastvideo_ltx2_pixels(video: bytes) -> tuple[torch.Tensor, float]:
    """`preprocess_ltx2_overfit.load_video`'s steps: frames resampled to 24 fps, cover (bilinear, antialias), centre
    crop, /127.5 - 1; and the native rate."""
    frames, native = _decoded(video)
    step = native / TRAIN_FPS
    wanted = [min(round(i * step), len(frames) - 1) for i in range(LTX2["frames"])]
    x = torch.from_numpy(frames[wanted]).permute(0, 3, 1, 2).float()
    height, width = LTX2["height"], LTX2["width"]
    scale = max(height / x.shape[2], width / x.shape[3])
    size = (round(x.shape[2] * scale), round(x.shape[3] * scale))
    x = F.interpolate(x, size=size, mode="bilinear", antialias=True)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    x = x[:, :, top : top + height, left : left + width] / 127.5 - 1.0
    return x.permute(1, 0, 2, 3).unsqueeze(0), native


@torch.inference_mode()
def test_fastvideo_trains_wan22_on_the_raw_posterior_mean_and_the_prompts_rows(collate, source, tiny_model, wan_caches):
    from diffusers import AutoencoderKLWan  # noqa: PLC0415 - the reference's own model load
    from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: PLC0415

    _, videos = source
    out = wan_caches["parquet"]
    batch = _collated(collate, out, WAN_TEXT_LEN)
    vae = AutoencoderKLWan.from_pretrained(tiny_model / "vae", torch_dtype=torch.float32).eval()
    encoder = UMT5EncoderModel.from_pretrained(tiny_model / "text_encoder", torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model / "tokenizer")
    for i, caption in enumerate(batch["caption_text"]):
        # FastVideo's Wan preprocessing: vae.encode(pixels).mean, stored as it is
        mean = vae.encode(_wan_pixels(videos[caption])).latent_dist.mean[0]
        assert_within_bf16_step(batch["vae_latent"][i], mean)
        # its T5 stage: padded to 512, last_hidden_state, cut to the prompt's tokens; the collate pads with zeros
        tokens = tokenizer(
            [caption], padding="max_length", max_length=WAN_TEXT_LEN, truncation=True, return_tensors="pt"
        )
        hidden = encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
        seq_len = int(tokens.attention_mask.sum())
        expected = torch.cat([hidden[:seq_len], torch.zeros(WAN_TEXT_LEN - seq_len, hidden.shape[1])])
        assert_within_bf16_step(batch["text_embedding"][i], expected)
        assert batch["text_attention_mask"][i].tolist() == [1.0] * seq_len + [0.0] * (WAN_TEXT_LEN - seq_len)
        info = batch["info_list"][i]
        native = _decoded(videos[caption])[1]
        effective = native * (WAN["frames"] - 1) / 19  # 17 frames spread over frames 0..19
        assert info["fps"] == pytest.approx(effective, abs=1e-5)
        assert info["duration_sec"] == pytest.approx(WAN["frames"] / effective, abs=1e-5)
    streamed = list(stream_samples(out))  # latentforge's own reader and inspect say what the consumer sees
    assert {s["consumer"]["latents"] for s in streamed} == {"raw_mean"}
    report = inspect_cache(out)
    assert report["consumer"]["latents"] == "raw_mean" and report["consumer"]["text_rows"] == "prompt"
    assert "written for  FastVideo 0.2.1" in format_report(report) and "latents raw_mean" in format_report(report)


def test_decode_and_verify_normalises_a_raw_mean_cache_before_decoding(wan_caches, tmp_path):
    scores = {}
    for fmt, out in wan_caches.items():  # the same samples, stored raw (FastVideo's) and normalised (the seed's)
        report = decode_and_verify(out, n=2, device="cpu", report_dir=tmp_path / f"decode-{fmt}")
        assert not report.problems
        scores[fmt] = {row.id: (row.psnr, np.asarray(Image.open(row.png), dtype=np.float32)) for row in report.rows}
    assert scores["parquet"].keys() == scores["pt"].keys()
    for key, (psnr, strip) in scores["parquet"].items():  # bf16 of the raw mean vs of the normalised latent
        assert psnr == pytest.approx(scores["pt"][key][0], abs=0.5)
        assert np.abs(strip - scores["pt"][key][1]).mean() < 1.0  # the decoded frames, in 8-bit levels


def test_a_fastvideo_wan22_cache_has_its_own_fingerprint(source, tiny_model, tmp_path):
    src, _ = source
    parquet = make_spec(config(src, tiny_model, tmp_path / "a", format="parquet", **WAN))[1]
    per_sample = make_spec(config(src, tiny_model, tmp_path / "b", format="pt", **WAN))[1]
    assert parquet.latent_norm == RAW_MEAN and per_sample.latent_norm != RAW_MEAN
    assert parquet.fingerprint() != per_sample.model_copy(update={"format": "parquet"}).fingerprint()


@torch.inference_mode()
def test_fastvideo_trains_ltx2_on_every_connector_row_at_the_resampled_rate(collate, source, ltx2_model, tmp_path):
    from diffusers import AutoencoderKLLTX2Video  # noqa: PLC0415 - the reference's own model load
    from diffusers.pipelines.ltx2 import LTX2TextConnectors  # noqa: PLC0415
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration  # noqa: PLC0415

    src, videos = source
    cfg = config(src, ltx2_model, tmp_path / "out", recipe="fastvideo-ltx2", **LTX2)
    out = _build(cfg)
    batch = _collated(collate, out, LTX2_TEXT_LEN)
    vae = AutoencoderKLLTX2Video.from_pretrained(ltx2_model / "vae", torch_dtype=torch.float32).eval()
    gemma = Gemma3ForConditionalGeneration.from_pretrained(ltx2_model / "text_encoder", torch_dtype=torch.float32)
    connectors = LTX2TextConnectors.from_pretrained(ltx2_model / "connectors", torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ltx2_model / "tokenizer")
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    mean, std = vae.latents_mean.view(-1, 1, 1, 1), vae.latents_std.view(-1, 1, 1, 1)
    for i, caption in enumerate(batch["caption_text"]):
        pixels, _ = _fastvideo_ltx2_pixels(videos[caption])
        # ltx-core's VAE returns the mean already normalised (diffusers': normalised by hand, as LTX2Pipeline does)
        z = vae.encode(pixels).latent_dist.mean[0]
        assert_within_bf16_step(batch["vae_latent"][i], (z - mean) * vae.config.scaling_factor / std)
        # the text encoder's forward: Gemma (left padded to 1024) → every hidden state → the connectors; all rows
        tokens = tokenizer(
            [caption.strip()], padding="max_length", max_length=LTX2_TEXT_LEN, truncation=True, return_tensors="pt"
        )
        hidden = gemma(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
        stacked = torch.stack(hidden.hidden_states, dim=-1).flatten(2, 3)
        video_embeds = connectors(stacked, tokens.attention_mask, padding_side="left")[0][0]
        assert_within_bf16_step(batch["text_embedding"][i], video_embeds)
        assert bool(batch["text_attention_mask"][i].eq(1).all())  # no pad rows for the collate to add
        info = batch["info_list"][i]
        assert (info["fps"], info["duration_sec"]) == (TRAIN_FPS, LTX2["frames"] / TRAIN_FPS)
    seen = inspect_cache(out)["consumer"]
    assert (seen["latents"], seen["text_rows"], seen["text_stage"]) == ("normalised", "all", "post_connector")


def test_pre_connector_text_into_parquet_is_refused_naming_fastvideo(source, ltx2_model, tmp_path):
    src, _ = source
    cfg = config(src, ltx2_model, tmp_path / "out", format="parquet", text_stage="pre_connector", **LTX2)
    with pytest.raises(ConfigError, match=r"FastVideo.*LTX2Model runs no connector"):
        make_spec(cfg)
    assert not (tmp_path / "out").exists()
