"""MiniMax-H3 for FastVideo (``--recipe h3-fastvideo``: ``--format parquet``, its t2va schema), through the CLI, and
against FastVideo 0.2.1's own released code (`tests.fastvideo_h3_ref`: its ``reference.py`` media functions, its
``build_parquet_record``, its ``schema.py`` and its ``dataset/utils.py`` collate, from the wheel).

Real clips: ``sample_1080p`` (23.976 fps, stereo AAC: the whole path), ``bigbuckbunny`` (25 fps, 5.1 AAC: FastVideo
refuses more than two channels, latentforge keeps the first two as DiffSynth-Studio does), ``carphone`` (no audio:
LTX-2's rule, the row records the track missing and reconciliation counts it). The tiny H3 repository
(`infra.demo.tiny_h3`) with the real geometry; 22 frames (17 + 5) at 64x96.

What is restated, not run: the VAE and conditioner calls (FastVideo's own ``AutoencoderKLMiniMaxH3`` and
``MiniMaxH3Qwen3VLConditioner`` are its reimplementations of diffusers' and transformers' classes, which need its
distributed runtime: the same arithmetic is run here with diffusers' VAE and transformers' Qwen3-VL and the tiny
weights), and the resampler (its ``torchaudio.transforms.Resample``: torchaudio is not installed here, so its own
``prepare_reference_waveform`` is run at the source rate and the 48 → 32 kHz step is `infra.media.audio.resample`,
torchaudio's kernel restated and tested in tests/test_audio.py).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from infra.cache import ledger
from infra.demo.testmedia import real_clip
from infra.errors import ConfigError
from infra.media.audio import Waveform, resample
from infra.media.temporal import resampled_indices
from infra.models import resolve_family
from tests import fastvideo_h3_ref as fv
from tests.fastvideo_ref import fastvideo_collate

runner = CliRunner()
FRAMES, HEIGHT, WIDTH = 22, 64, 96
TEXT_LEN = 1024  # its MiniMaxH3Qwen3VLArchConfig.text_len: what its collate pads to
CLIPS = {
    "street": ("sample_1080p", "Cars drive down a city street at dusk."),
    "bunny": ("bigbuckbunny", "A big rabbit wakes up in a meadow."),
    "carphone": ("carphone", "A man talks in a car."),
}
PIXEL_MEAN = torch.tensor((0.485, 0.456, 0.406)).view(1, -1, 1, 1, 1)
PIXEL_STD = torch.tensor((0.229, 0.224, 0.225)).view(1, -1, 1, 1, 1)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("h3-clips")
    for stem, (clip, caption) in CLIPS.items():
        shutil.copy(real_clip(clip), root / f"{stem}.mp4")
        (root / f"{stem}.txt").write_text(caption, encoding="utf-8")
    return root


def _build(source: Path, model: Path, out: Path, *extra: str) -> str:
    args = ["build", "--source", f"folder:{source}", "--model", str(model), "--out", str(out)]
    args += ["--recipe", "h3-fastvideo", "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    args += ["--device", "cpu", "--dtype", "fp32", "--on-conflict", "abort", "--on-loss", "accept", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def built(source: Path, h3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("h3-fastvideo") / "out"
    _build(source, h3_model, out, "--decode-samples", "0")
    return out


@functools.cache
def _media() -> dict:
    return fv.media(HEIGHT, WIDTH)


def _rows(out: Path) -> dict[str, dict]:
    parts = sorted((out / "shards").glob("*.parquet"))
    return {row["file_name"]: row for part in parts for row in pq.read_table(part).to_pylist()}


@pytest.mark.slow
def test_build_resume_verify_decode_through_the_cli(built, source, h3_model):
    rows = {row.id: row for shard in ledger.read_all(built).values() for row in shard.values()}
    assert {r.status for r in rows.values()} == {"done"}
    assert rows["carphone.mp4"].missing == {"audio_latents": "no_audio_track: the file has no audio stream"}
    assert not rows["street.mp4"].missing and not rows["bunny.mp4"].missing
    again = _build(source, h3_model, built, "--decode-samples", "0")  # the same command: everything reused
    assert "3 done (0 encoded now, 3 reused)" in again, again
    verified = runner.invoke(app, ["verify", str(built)])
    assert verified.exit_code == 0, verified.output
    decoded = runner.invoke(app, ["decode", str(built), "--decode-samples", "3"])
    assert decoded.exit_code == 0, decoded.output
    assert "per channel" in decoded.output and "3 sample(s)" in decoded.output, decoded.output
    audio = runner.invoke(app, ["audio-check", str(built)])
    assert audio.exit_code == 0, audio.output
    assert "2 of 3 done samples have audio, 1 not" in audio.output and "carphone.mp4" in audio.output, audio.output


def test_the_family_is_told_from_the_modular_index(h3_model, tmp_path):
    assert resolve_family(h3_model, None, audio=True).name == "h3"
    bare = tmp_path / "bare"
    shutil.copytree(h3_model, bare)
    (bare / "modular_model_index.json").unlink()
    with pytest.raises(ConfigError, match=r"no model_index.json \(or modular_model_index.json\)"):
        resolve_family(bare, None)


@pytest.mark.slow
def test_fastvideos_collate_hands_its_trainer_what_its_own_preprocessing_makes(built, source, h3_model):
    """Each row, collated by its own ``collate_rows_from_parquet_schema`` with its ``pyarrow_schema_t2va``, equals
    its own preprocessing of the same clip: frames by its ``reference.py`` functions, the VAE sample under seed 42,
    stereo audio through the audio VAE's mode, ``hidden_states[50]`` of the bare prompt; and the row is its own
    ``build_parquet_record`` of those tensors, column for column."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio  # noqa: PLC0415 - heavy
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration  # noqa: PLC0415 - heavy

    funcs, collate, schema = _media(), fastvideo_collate(), fv.schema().pyarrow_schema_t2va
    record = fv.build_parquet_record(HEIGHT, WIDTH, FRAMES)
    vae = AutoencoderKLMiniMaxH3.from_pretrained(h3_model / "vae").eval()
    audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(h3_model / "audio_vae").eval()
    conditioner = Qwen3VLForConditionalGeneration.from_pretrained(h3_model / "text_encoder").eval()
    tokenizer = AutoTokenizer.from_pretrained(h3_model / "tokenizer")
    rows = _rows(built)
    for name, (_, caption) in CLIPS.items():
        row = rows[f"{name}.mp4"]
        batch = collate.collate_rows_from_parquet_schema([row], schema, TEXT_LEN)
        frames, fps, soundtrack = funcs["decode_reference_video"](source / f"{name}.mp4")
        clip = funcs["prepare_reference_frames"](funcs["resample_reference_frames"](frames, fps), FRAMES)
        with torch.no_grad():
            pixels = torch.from_numpy(clip.copy()).permute(3, 0, 1, 2)[None].float().div_(255.0)
            posterior = vae.encode((pixels - PIXEL_MEAN) / PIXEL_STD).latent_dist
            z = posterior.sample(generator=torch.Generator("cpu").manual_seed(42))
            video = ((z - _stat(vae.config.latents_mean)) / _stat(vae.config.latents_std))[0]
            ids = tokenizer(caption, add_special_tokens=False)["input_ids"]
            text = _hidden_50(conditioner, ids)
        assert torch.equal(batch["vae_latent"][0], video), name
        assert torch.equal(batch["text_embedding"][0, : len(ids)], text), name
        assert not batch["text_embedding"][0, len(ids) :].any() and batch["text_attention_mask"][0].sum() == len(ids)
        audio = _fastvideo_audio(funcs, soundtrack, audio_vae) if name == "street" else None
        if name == "street":
            assert torch.equal(batch["audio_latent"][0], audio)
            assert batch["audio_latent"].shape == (1, 2, 32, round(FRAMES / 24 * 40))  # its prepare_batch's rule
            theirs = record(
                file_name=row["file_name"],
                caption=caption,
                video_latents=video,
                audio_latents=audio,
                text_embedding=text,
            )
            assert theirs == row, sorted(k for k in row if theirs.get(k) != row[k])
        elif name == "bunny":  # 5.1: its prepare_reference_waveform refuses; the first two channels are kept here
            with pytest.raises(ValueError, match="mono or stereo"):
                funcs["prepare_reference_waveform"](*soundtrack, soundtrack[1], max_duration=FRAMES / 24)
            assert batch["audio_latent"].shape == (1, 2, 32, round(FRAMES / 24 * 40))
        else:  # no soundtrack: its preprocessing refuses the clip; the row has none, recorded missing
            assert soundtrack is None and batch["audio_latent"][0].numel() == 0


def _stat(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1, 1)


def _hidden_50(conditioner: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """diffusers' ``get_qwen3vl_prompt_embeds`` of a text-only presentation (FastVideo's conditioner computes the
    same layer-50 hidden state), on the whole untruncated model."""
    input_ids = torch.tensor([ids])
    out = conditioner.model(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=torch.zeros_like(input_ids),
        use_cache=False,
        output_hidden_states=True,
    )
    return out.hidden_states[50][0].float()


def _fastvideo_audio(funcs: dict, soundtrack: tuple, audio_vae: torch.nn.Module) -> torch.Tensor:
    """Its ``encode_audio_latents`` of its ``load_training_media`` waveform: its own trim and stereo step (at the
    source rate), torchaudio's resample to 32 kHz, the mono VAE over the two channels, the mode, normalised."""
    waveform, rate = soundtrack
    stereo = funcs["prepare_reference_waveform"](waveform, rate, rate, max_duration=FRAMES / 24)
    wave = resample(Waveform(stereo.contiguous(), rate), 32000).samples
    with torch.no_grad():
        mode = audio_vae.encode(wave[:, None]).latent_dist.mode()
    mean = torch.tensor(audio_vae.config.latents_mean).view(1, -1, 1)
    return (mode - mean) / torch.tensor(audio_vae.config.latents_std).view(1, -1, 1)


def test_h3_parquet_refuses_bf16_rows_fastvideo_stores_in_float32(source, h3_model, tmp_path):
    args = ["build", "--source", f"folder:{source}", "--model", str(h3_model), "--out", str(tmp_path / "o")]
    args += ["--recipe", "h3-fastvideo", "--frames", "22", "--height", "64", "--width", "96", "--store-dtype", "bf16"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "--store-dtype bf16: its consumer, FastVideo 0.2.1" in result.output
    assert not (tmp_path / "o").exists()


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 400),
    fps=st.sampled_from([23.976023976023978, 24.0, 25.0, 29.97002997002997, 30.0, 50.0, 59.94005994005994, 12.5]),
)
def test_resample_24_puts_frames_where_fastvideos_h3_reader_puts_them(total, fps):
    frames = np.arange(total).reshape(total, 1, 1, 1).repeat(3, axis=3).astype(np.int64)
    theirs = _media()["resample_reference_frames"](frames, fps)[:, 0, 0, 0]
    assert np.array_equal(resampled_indices(total, fps, 24.0), theirs)
