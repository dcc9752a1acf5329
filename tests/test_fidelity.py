"""The default recipe, bit for bit: the cache equals a straight-line implementation written here.

The reference below shares no code with the pipeline and follows the published steps literally: it decodes
every frame with PyAV, picks linspace indices, normalises, resizes, runs the VAE (posterior mode, (z-mean)/std)
and UMT5 (padded to 512, ``last_hidden_state`` stored as is, pad rows included), all to bf16.
"""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from transformers import AutoTokenizer, UMT5EncoderModel

from flows.terminal_run import run_build
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip

MAX_LENGTH = 512
PROMPTS = (
    "A large grey rabbit climbs out of its burrow.",
    "Cyclists ride through city traffic past a grey van.",
    "A man in a suit talks in the back seat of a car.",
    "A deer grazes on leafy bushes beside a gravel path.",
    "A short clip: the man turns his head.",
)


def reference(video: bytes, prompt: str, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    container = av.open(io.BytesIO(video))
    frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    container.close()
    idx = np.linspace(0, len(frames) - 1, FRAMES).round().astype(int)
    x = torch.from_numpy(np.stack([frames[i] for i in idx])).float() / 127.5 - 1
    x = x.permute(0, 3, 1, 2)
    x = torch.nn.functional.interpolate(x, size=(HEIGHT, WIDTH), mode="bilinear", align_corners=False)
    x = x.permute(1, 0, 2, 3).unsqueeze(0)

    vae = AutoencoderKLWan.from_pretrained(model_dir / "vae", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 48, 1, 1, 1)
    x0 = ((z - mean) / std).to(torch.bfloat16)[0]

    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(model_dir / "text_encoder", torch_dtype=torch.float32).eval()
    tokens = tokenizer(
        prompt,
        padding="max_length",
        max_length=MAX_LENGTH,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        hidden = encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
    seq_len = int(tokens.attention_mask.sum())
    return x0, hidden.to(torch.bfloat16), seq_len  # stored as is: the pad rows hold the encoder's own output


@pytest.fixture(scope="module")
def real_videos(clips: dict[str, bytes]) -> list[bytes]:
    """Real clips as the recipe sees them: 720p (132 frames), 640×272 (250), QCIF (120), 1080p (23),
    and a 7-frame cut, shorter than F, so frames repeat."""
    short = cut_clip(clips["carphone"], 7)
    return [clips["bigbuckbunny"], clips["bikes"], clips["carphone"], clips["sample_1080p"], short]


@pytest.fixture(scope="module")
def references(t5_model: Path, real_videos: list[bytes]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The straight-line recipe's (x0, text_embeds, seq_len) of each clip and prompt, computed once for the module."""
    return [reference(video, prompt, t5_model) for video, prompt in zip(real_videos, PROMPTS, strict=True)]


@pytest.mark.parametrize(
    "options",
    [{}, {"decode_pool": "process", "decode_workers": 2}],
    ids=["default", "decoder-processes"],  # the decoder processes' pixels are the threads' pixels, bit for bit
)
def test_cache_is_bit_identical_to_the_straight_line_recipe(tmp_path, t5_model, real_videos, references, options):
    samples = [
        sample(i % 2, i, video, prompt.encode())
        for i, (video, prompt) in enumerate(zip(real_videos, PROMPTS, strict=True))
    ]
    src = make_shards(tmp_path / "src", {"shard-00000": samples[:3], "shard-00001": samples[3:]})
    ok, result = run_build(config(src, t5_model, tmp_path / "out", **options))
    assert ok, result
    assert result["done"] == len(samples)

    for item, prompt, (x0, text, seq_len) in zip(samples, PROMPTS, references, strict=True):
        stored = torch.load(tmp_path / "out" / item.generator / f"{item.task}_{item.index:08d}.pt", weights_only=True)
        assert stored["x0"].dtype == torch.bfloat16 and stored["text_embeds"].dtype == torch.bfloat16
        assert list(stored["x0"].shape) == [48, 1 + (FRAMES - 1) // 4, HEIGHT // 16, WIDTH // 16]
        assert list(stored["text_embeds"].shape) == [MAX_LENGTH, 64]
        assert torch.equal(stored["x0"], x0), f"x0 differs for {item.sample_dir}"
        assert torch.equal(stored["text_embeds"], text), f"text_embeds differ for {item.sample_dir}"
        assert stored["seq_len"] == seq_len > 1
        assert stored["prompt"] == prompt
        assert stored["latent_shape"] == list(x0.shape)
        assert stored["fingerprint"] == result["fingerprint"]


def test_source_shape_counts_decoded_frames(tmp_path, t5_model, real_videos):
    item = sample(0, 0, real_videos[4], PROMPTS[4].encode())
    src = make_shards(tmp_path / "src", {"short": [item]})
    ok, result = run_build(config(src, t5_model, tmp_path / "out"))
    assert ok, result
    stored = torch.load(tmp_path / "out" / item.generator / f"{item.task}_00000000.pt", weights_only=True)
    assert stored["source_shape"] == [7, 144, 176, 3]


def test_zero_padding_is_the_option_that_zeroes_only_the_pad_rows(tmp_path, t5_model, real_videos, references):
    item = sample(0, 0, real_videos[2], PROMPTS[2].encode())
    src = make_shards(tmp_path / "src", {"s": [item]})
    ok, result = run_build(config(src, t5_model, tmp_path / "out", text_padding="zeros"))
    assert ok, result
    stored = torch.load(tmp_path / "out" / item.generator / f"{item.task}_00000000.pt", weights_only=True)
    _, raw, seq_len = references[2]
    assert torch.equal(stored["text_embeds"][:seq_len], raw[:seq_len])
    assert not stored["text_embeds"][seq_len:].any() and raw[seq_len:].abs().sum() > 0
