"""musubi-tuner's HunyuanVideo 1.5 cache files (architecture code ``hv15``): what goes in them.

Restated from kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7
(``src/musubi_tuner/dataset/cache_io.py`` ``save_latent_cache_hunyuan_video_1_5`` /
``save_text_encoder_output_cache_hunyuan_video_1_5``, ``save_latent_cache_common``,
``save_text_encoder_output_cache_common``; ``hv_1_5_cache_latents.py``, ``hv_1_5_cache_text_encoder_outputs.py``):

* ``{name}_{start:05d}-{F:03d}_{W:04d}x{H:04d}_hv15.safetensors``: ``latents_{F'}x{H'}x{W'}_{dtype}`` [32, F', H', W'],
  the raw posterior mode in the dtype its VAE ran in (``--vae_dtype``; here the spec's ``--store-dtype``);
  metadata ``architecture=hunyuan_video_1_5``, ``width``, ``height``, ``frame_count``, ``format_version=1.0.1``;
* ``--mode i2v`` (musubi's ``--i2v``) adds ``latents_image_{F'}x{H'}x{W'}_{dtype}`` [33, F', H', W'] (musubi writes
  float32 holding its VAE dtype's values; latentforge the ``--store-dtype``: the same values in a bf16 run) and
  ``siglip_float16`` [729, 1152];
* ``{name}_hv15_te.safetensors``: ``varlen_vl_embed_{dtype}`` [L, D] (the Qwen2.5-VL rows of the prompt's tokens)
  and ``varlen_byt5_embed_float16`` [g, D2] (the glyph rows; g is 0 for a prompt with no quoted text: musubi writes
  that empty tensor as float32, its zeros' default dtype; latentforge writes it float16 like every other glyph
  tensor: its loader drops the dtype from the key and its trainer's ``pad_varlen`` casts to the network dtype, so the
  batch is the same); metadata ``architecture``, ``caption1``, ``format_version``.

The names, the buckets, the metadata marks and the dataset config are `infra.formats.musubi`'s (the same for every
architecture musubi caches).
"""

from __future__ import annotations

import torch

from infra.formats.base import CLIP_KIND, GLYPH_KIND, IMAGE_LATENTS_KIND, EncodedSample

CODE = "hv15"
FULL_NAME = "hunyuan_video_1_5"
#: Output kind → the key musubi's loader gives it in a batch (its ``BucketBatchManager``).
KEYS = {
    "latents": "latents",
    "text_embeddings": "vl_embed",
    GLYPH_KIND: "byt5_embed",
    IMAGE_LATENTS_KIND: "latents_image",
    CLIP_KIND: "siglip",
}


def dtype_name(tensor: torch.Tensor) -> str:
    """musubi's ``dtype_to_str``: torch's name of the dtype (``bfloat16``, ``float16``)."""
    return str(tensor.dtype).removeprefix("torch.")


def latent_tensors(sample: EncodedSample) -> dict[str, torch.Tensor]:
    """The latents file's tensors."""
    latents = sample.latents
    assert latents is not None
    _, f, h, w = latents.shape
    tensors = {f"latents_{f}x{h}x{w}_{dtype_name(latents)}": latents.contiguous()}
    if isinstance(image := sample.extras.get(IMAGE_LATENTS_KIND), torch.Tensor):  # --mode i2v: musubi's --i2v
        tensors[f"latents_image_{f}x{h}x{w}_{dtype_name(image)}"] = image.contiguous()
    if isinstance(siglip := sample.extras.get(CLIP_KIND), torch.Tensor):
        tensors[f"siglip_{dtype_name(siglip)}"] = siglip.to(torch.float16).contiguous()
    return tensors


def text_tensors(sample: EncodedSample) -> dict[str, torch.Tensor]:
    """The text file's tensors: the prompt's Qwen2.5-VL rows and its glyph rows."""
    assert sample.text_embeds is not None
    vl = sample.text_embeds[: sample.seq_len].contiguous()
    glyph = sample.extras[GLYPH_KIND].to(torch.float16).contiguous()
    return {f"varlen_vl_embed_{dtype_name(vl)}": vl, "varlen_byt5_embed_float16": glyph}
