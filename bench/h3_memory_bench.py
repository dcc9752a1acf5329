"""MiniMax-H3's two encoding stages on one card: the Qwen3-VL conditioner (text) and the float32 video VAE (video),
sized at the released models' parameter counts by arithmetic.

Each model is built at its real config on the ``meta`` device (shapes, no memory): its parameters are counted
exactly, and one pass of the real input is traced there too, each module's output size recorded. A stage's peak is
its weights in the dtype it runs in, plus its activations: the text stage keeps every hidden state
(``output_hidden_states``) and a layer's MLP intermediate; the video stage one tile of one 17-frame chunk (tiling on,
256x256, as released) with the two largest activations of its encoder alive together (a resnet block's input and
output). The tiny models of the tests (`infra.demo.tiny_h3`) run the same code; only the widths differ.

    PYTHONPATH=. python bench/h3_memory_bench.py
"""

from __future__ import annotations

import json
import logging

import torch

logger = logging.getLogger("h3_memory_bench")
GIB = 2**30
#: The released conditioner's text and vision config (DiffSynth-Studio's ``MiniMaxH3TextEncoder`` restates it).
TEXT = {
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                        "mrope_interleaved": True},
}  # fmt: skip
VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 5120,
          "deepstack_visual_indexes": [8, 16, 24]}  # fmt: skip
PROMPT_TOKENS = 1024  # FastVideo's text_len: the longest prompt a row holds
FRAMES, HEIGHT, WIDTH = 124, 768, 1344  # the h3-fastvideo recipe's geometry


def conditioner_params(layers: int) -> dict[str, int]:
    """Parameters of the Qwen3-VL conditioner with `layers` decoder layers: all, and those in Linear layers (what
    LLM.int8() stores in 8 bits; lm_head stays in 16)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration  # noqa: PLC0415 - heavy: transformers

    config = Qwen3VLConfig(text_config={**TEXT, "num_hidden_layers": layers}, vision_config=VISION)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    linear = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    )
    return {"all": sum(p.numel() for p in model.parameters()), "linear": linear}


def vae_stage() -> dict[str, float]:
    """The float32 video VAE: parameters (encoder, decoder) and one tile's activations of the encoder."""
    from diffusers import AutoencoderKLMiniMaxH3  # noqa: PLC0415 - heavy: diffusers

    with torch.device("meta"):
        vae = AutoencoderKLMiniMaxH3()
    sizes: list[int] = []
    leaves = [m for m in vae.encoder.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel())) for m in leaves]
    with torch.no_grad():
        vae.encoder(torch.empty(1, 3, vae.config.clip_length, 256, 256, device="meta"))
    for hook in hooks:
        hook.remove()
    largest = sorted(sizes)[-2:]
    encoder = sum(p.numel() for p in vae.encoder.parameters()) + sum(p.numel() for p in vae.quant_conv.parameters())
    return {
        "encoder_params": encoder,
        "all_params": sum(p.numel() for p in vae.parameters()),
        "activation_bytes": 4 * sum(largest),
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded, full = conditioner_params(51), conditioner_params(64)
    hidden = 51 * PROMPT_TOKENS * TEXT["hidden_size"] * 2 + 3 * PROMPT_TOKENS * TEXT["intermediate_size"] * 2
    bf16 = loaded["all"] * 2
    int8 = loaded["linear"] + (loaded["all"] - loaded["linear"]) * 2
    vae = vae_stage()
    rows = {
        "text: Qwen3-VL, 64 layers, bf16 (what a whole load holds)": full["all"] * 2 / GIB,
        "text: the 51 layers hidden_states[50] needs, bf16": (bf16 + hidden) / GIB,
        "text: the 51 layers, 8-bit (--load-text-encoder-in-8bit)": (int8 + hidden) / GIB,
        "video: the float32 VAE (encoder + decoder) and one tile's encoder activations": (
            vae["all_params"] * 4 + vae["activation_bytes"]
        )
        / GIB,
    }
    facts = {
        "conditioner_params_64_layers": full["all"],
        "conditioner_params_51_layers": loaded["all"],
        "vae_params": vae["all_params"],
        "vae_encoder_params": vae["encoder_params"],
    }
    for name, gib in rows.items():
        logger.info("%-80s %6.1f GiB", name, gib)
    logger.info("%s", json.dumps(facts))


if __name__ == "__main__":
    main()
