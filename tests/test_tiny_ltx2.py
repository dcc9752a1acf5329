"""The tiny LTX-2 snapshot: deterministic bytes, every component loads offline, and the facts the ltx2 family
relies on (latent shapes, where the statistics live, the audio pack order, the Gemma stacking, the
pre-connector features) hold against diffusers' own LTX2Pipeline code."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.connectors import per_layer_masked_mean_norm
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, GemmaTokenizerFast

from infra.demo.tiny_ltx2 import MAX_SEQUENCE_LENGTH, MODEL_INDEX, latent_statistics, make_tiny_ltx2

PROMPT = "A red ball rolls through a narrow maze, slowly."
COMPONENTS = ("vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "scheduler")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny ops on 2 shared cores: a second intra-op thread makes a 1024x64 matmul ~80x slower here."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_ltx2(tmp_path_factory.mktemp("models") / "tiny-ltx2", seed=0)


@pytest.fixture(scope="module")
def vae(snapshot: Path) -> AutoencoderKLLTX2Video:
    return AutoencoderKLLTX2Video.from_pretrained(snapshot / "vae", local_files_only=True).eval()


@pytest.fixture(scope="module")
def audio_vae(snapshot: Path) -> AutoencoderKLLTX2Audio:
    return AutoencoderKLLTX2Audio.from_pretrained(snapshot / "audio_vae", local_files_only=True).eval()


@pytest.fixture(scope="module")
def text_encoder(snapshot: Path) -> Gemma3ForConditionalGeneration:
    return Gemma3ForConditionalGeneration.from_pretrained(snapshot / "text_encoder", local_files_only=True).eval()


@pytest.fixture(scope="module")
def tokenizer(snapshot: Path) -> GemmaTokenizerFast:
    return AutoTokenizer.from_pretrained(snapshot / "tokenizer", local_files_only=True)


@pytest.fixture(scope="module")
def connectors(snapshot: Path) -> LTX2TextConnectors:
    return LTX2TextConnectors.from_pretrained(snapshot / "connectors", local_files_only=True).eval()


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _tokenize(tokenizer, prompts: list[str]):
    """Exactly LTX2Pipeline._get_gemma_prompt_embeds' tokenizer call."""
    tokenizer.padding_side = "left"
    return tokenizer(
        [p.strip() for p in prompts],
        padding="max_length",
        max_length=MAX_SEQUENCE_LENGTH,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )


def test_same_seed_gives_identical_bytes_and_a_used_dir_is_refused(snapshot, tmp_path):
    again = make_tiny_ltx2(tmp_path / "again", seed=0)
    first, second = _hashes(snapshot), _hashes(again)
    assert first == second
    assert {name.split("/")[0] for name in first} == {*COMPONENTS, "model_index.json"}
    assert not (snapshot / "transformer").exists() and not (snapshot / "vocoder").exists()
    other = _hashes(make_tiny_ltx2(tmp_path / "other", seed=1))
    assert other["vae/diffusion_pytorch_model.safetensors"] != first["vae/diffusion_pytorch_model.safetensors"]
    assert other["tokenizer/tokenizer.json"] == first["tokenizer/tokenizer.json"]
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        make_tiny_ltx2(tmp_path / "used")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other", "used"]  # no staging dir left


def test_model_index_and_every_component_load_offline(snapshot, vae, audio_vae, text_encoder, tokenizer, connectors):
    index = json.loads((snapshot / "model_index.json").read_text())
    assert index == {**MODEL_INDEX, "_diffusers_version": index["_diffusers_version"]}
    assert index["connectors"] == ["ltx2", "LTX2TextConnectors"] and index["vocoder"] == ["ltx2", "LTX2Vocoder"]
    assert type(tokenizer) is GemmaTokenizerFast  # = GemmaTokenizer in transformers 5
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(snapshot / "scheduler", local_files_only=True)
    assert scheduler.config.use_dynamic_shifting and scheduler.config.shift_terminal == 0.1
    pipe = LTX2Pipeline.from_pretrained(snapshot, transformer=None, vocoder=None, local_files_only=True)
    assert type(pipe.connectors) is LTX2TextConnectors and type(pipe.text_encoder) is Gemma3ForConditionalGeneration
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    assert (pipe.audio_vae_temporal_compression_ratio, pipe.audio_vae_mel_compression_ratio) == (4, 4)
    assert (pipe.audio_sampling_rate, pipe.audio_hop_length, pipe.audio_vae.config.mel_bins) == (16000, 160, 64)


def test_tokenizer_is_gemma_like(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")]
    assert ids == [0, 1, 2, 3, 4] and tokenizer.pad_token_id == 0 and len(tokenizer) <= 384
    batch = _tokenize(tokenizer, [PROMPT, "é " * 2000])
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, MAX_SEQUENCE_LENGTH)
    n = int(batch.attention_mask[0].sum())
    assert batch.attention_mask[0, -n:].all() and not batch.attention_mask[0, :-n].any()  # left padding
    assert batch.input_ids[0, -n] == tokenizer.bos_token_id and (batch.input_ids[0, :-n] == 0).all()
    assert tokenizer.decode(batch.input_ids[0], skip_special_tokens=True) == PROMPT
    assert batch.attention_mask[1].all() and batch.input_ids[1, 0] == tokenizer.bos_token_id  # truncated


def test_video_latents_shape_and_statistics(vae):
    assert vae.config.scaling_factor == 1.0 and vae.latents_mean.shape == vae.latents_std.shape == (128,)
    mean, std = latent_statistics(0, "vae")
    assert torch.equal(vae.latents_mean, mean) and torch.equal(vae.latents_std, std)
    assert not torch.allclose(vae.latents_mean, torch.zeros(128)) and not torch.allclose(
        vae.latents_std, torch.ones(128)
    )
    x = torch.rand(1, 3, 17, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        assert z.shape == (1, 128, 3, 2, 3)
        normed = LTX2Pipeline._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        view = (1, -1, 1, 1, 1)
        manual = (z - vae.latents_mean.view(view)) * vae.config.scaling_factor / vae.latents_std.view(view)
        assert torch.equal(normed, manual)
        back = LTX2Pipeline._denormalize_latents(normed, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        torch.testing.assert_close(back, z)
        assert vae.decode(back).sample.shape == (1, 3, 17, 64, 96)


@pytest.mark.parametrize(("mel_frames", "latent_frames"), [(101, 26), (133, 34)])  # 133 = 1.32 s: 21120 // 160 + 1
def test_audio_latents_shape_pack_order_and_statistics(audio_vae, mel_frames, latent_frames):
    assert audio_vae.latents_mean.shape == audio_vae.latents_std.shape == (128,)
    mean, std = latent_statistics(0, "audio_vae")
    assert torch.equal(audio_vae.latents_mean, mean) and torch.equal(audio_vae.latents_std, std)
    mel = torch.randn(1, 2, mel_frames, 64, generator=torch.Generator().manual_seed(1))  # [B, stereo, T, mel bins]
    with torch.no_grad():
        z = audio_vae.encode(mel).latent_dist.mean
        assert z.shape == (1, 8, latent_frames, 16)
        packed = LTX2Pipeline._pack_audio_latents(z)  # [B, T', C * M], index c * 16 + m
        assert packed.shape == (1, latent_frames, 128) and packed[0, 5, 3 * 16 + 7] == z[0, 3, 5, 7]
        normed = LTX2Pipeline._normalize_audio_latents(packed, audio_vae.latents_mean, audio_vae.latents_std)
        unpacked = LTX2Pipeline._unpack_audio_latents(normed, latent_frames, num_mel_bins=16)  # [B, 8, T', 16]
        view = (1, 8, 1, 16)
        manual = (z - audio_vae.latents_mean.view(view)) / audio_vae.latents_std.view(view)
        torch.testing.assert_close(unpacked, manual, rtol=0, atol=1e-6)
        back = LTX2Pipeline._denormalize_audio_latents(normed, audio_vae.latents_mean, audio_vae.latents_std)
        decoded = audio_vae.decode(LTX2Pipeline._unpack_audio_latents(back, latent_frames, num_mel_bins=16)).sample
        assert decoded.shape == (1, 2, 4 * latent_frames - 3, 64)  # causal: 4T' - 3 mel frames


def test_text_hidden_states_stack_as_the_pipeline_and_connectors_run(snapshot, text_encoder, tokenizer, connectors):
    batch = _tokenize(tokenizer, [PROMPT])
    with torch.no_grad():
        out = text_encoder(batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and all(h.shape == (1, MAX_SEQUENCE_LENGTH, 64) for h in out.hidden_states)
        stacked = torch.stack(out.hidden_states, dim=-1)  # [B, L, D, layers + 1]
        flat = stacked.flatten(2, 3)  # [B, L, D * 3], index d * 3 + layer
        assert flat[0, -1, 5 * 3 + 2] == out.hidden_states[2][0, -1, 5]
        pipe = LTX2Pipeline.from_pretrained(snapshot, transformer=None, vocoder=None, local_files_only=True)
        embeds, mask = pipe._get_gemma_prompt_embeds(PROMPT, device=torch.device("cpu"))
        assert embeds.dtype == text_encoder.dtype == torch.float32
        torch.testing.assert_close(embeds, flat, rtol=0, atol=0)
        assert torch.equal(mask, batch.attention_mask)
        video, audio, out_mask = connectors(flat, batch.attention_mask)
    assert video.shape == audio.shape == (1, MAX_SEQUENCE_LENGTH, 64) and out_mask.shape == (1, MAX_SEQUENCE_LENGTH)
    assert out_mask.all()  # registers fill the padding: the mask comes back all ones
    assert MAX_SEQUENCE_LENGTH % connectors.config.video_connector_num_learnable_registers == 0


def test_pre_connector_features_are_what_text_proj_in_receives(text_encoder, tokenizer, connectors):
    batch = _tokenize(tokenizer, [PROMPT, "A blue cube."])
    seen: dict[str, torch.Tensor] = {}

    def hook(module, inputs, output):
        seen["in"], seen["out"] = inputs[0], output

    with torch.no_grad():
        out = text_encoder(batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        stacked = torch.stack(out.hidden_states, dim=-1)
        normed = per_layer_masked_mean_norm(
            stacked, batch.attention_mask.sum(dim=-1), device=stacked.device, padding_side="left", scale_factor=8
        )
        pre = connectors.text_proj_in(normed)  # [B, 1024, 64]: what the LTX-2 trainer caches
        handle = connectors.text_proj_in.register_forward_hook(hook)
        try:
            connectors(stacked.flatten(2, 3), batch.attention_mask)
        finally:
            handle.remove()
    assert torch.equal(seen["in"], normed) and torch.equal(seen["out"], pre)
    assert pre.shape == (2, MAX_SEQUENCE_LENGTH, 64)
    padding = batch.attention_mask == 0
    assert (pre[padding] == 0).all() and (pre[~padding] != 0).any()  # no bias: padded rows are exact zeros


def test_a_given_tokenizer_dir_is_used(snapshot, tmp_path, tokenizer):
    made = make_tiny_ltx2(tmp_path / "with-tokenizer", seed=0, tokenizer_dir=snapshot / "tokenizer")
    reloaded = AutoTokenizer.from_pretrained(made / "tokenizer", local_files_only=True)
    assert reloaded(PROMPT).input_ids == tokenizer(PROMPT).input_ids
    config = json.loads((made / "text_encoder" / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == 384 and config["image_token_index"] == 9
    with pytest.raises(FileNotFoundError):
        make_tiny_ltx2(tmp_path / "missing", tokenizer_dir=tmp_path / "nope")
