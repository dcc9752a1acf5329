"""The two Qwen-Image consumers' own caching, on the tiny snapshot, for the parity tests (tests only).

* musubi-tuner is not on PyPI: its Qwen-Image caching is restated here from kohya-ss/musubi-tuner at commit
  30c658c4f4b0bf05038b3346eff9670259b10fc7, step by step: ``dataset/datasources.py`` (``Image.open``, a mode other
  than RGB/RGBA converted to RGB), ``dataset/image_video_dataset.py`` ``ImageDataset.retrieve_latent_cache_batches``
  (its ``BucketSelector`` bucket of the image's size, ``media_utils.resize_image_to_bucket`` of the PIL image),
  ``cache_latents.encode_datasets`` (alpha dropped), ``qwen_image_cache_latents.py``
  ``preprocess_contents_qwen_image`` (``contents / 127.5 - 1.0`` in float32) and its VAE's
  ``encode_pixels_to_latents`` (mode, then ``(latents - mean) * (1 / std)`` in the VAE's dtype: bf16, the released
  weights' dtype, which its loader keeps), ``qwen_image_utils.get_qwen_prompt_embeds`` (the template, max_length
  1024 + 34, ``hidden_states[-1]``, the masked rows past 34, the VLM's bf16) and
  ``qwen_image_cache_text_encoder_outputs.py`` (``embed_i[:txt_len]``). Its VAE class is diffusers'
  ``AutoencoderKLQwenImage`` copied; the diffusers one runs here.
* DiffSynth-Studio's own code runs from the ``diffsynth`` 2.1.12 wheel (`tests.diffsynth_ref`): its
  ``QwenImagePipeline`` with its ``QwenImageVAE`` (the snapshot's VAE weights, loaded as its model manager loads
  them: diffusers' names) and its ``QwenImageTextEncoder`` (the snapshot's Qwen2.5-VL weights through its own
  ``QwenImageTextEncoderStateDictConverter``, from the released checkpoint's names), its ``LoadImage`` and
  ``ImageCropAndResize``, and its unit runner over the units its ``--task sft:data_process`` runs; the inputs its
  ``examples/qwen_image/model_training/train.py`` ``get_pipeline_inputs`` builds are restated (commit fed7b18f).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from infra.models.base import read_json
from infra.models.qwen_image import DROP_INDEX, TEMPLATE
from tests import diffsynth_ref
from tests.musubi_reader import BucketSelector

MUSUBI_TEXT_MAX = 1024


def musubi_resize(image: Image.Image, bucket: tuple[int, int]) -> np.ndarray:
    """Its ``resize_image_to_bucket`` for a PIL image, restated (bucket: (width, height))."""
    if bucket == image.size:
        return np.array(image)
    scale = max(bucket[0] / image.size[0], bucket[1] / image.size[1])
    size = (int(image.size[0] * scale + 0.5), int(image.size[1] * scale + 0.5))
    if scale > 1:
        array = np.array(image.resize(size, Image.LANCZOS))
    else:
        array = cv2.resize(np.array(image), size, interpolation=cv2.INTER_AREA)
    left, top = (size[0] - bucket[0]) // 2, (size[1] - bucket[1]) // 2
    return array[top : top + bucket[1], left : left + bucket[0]]


def musubi_pixels(data: bytes, resolution: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """(its float32 contents (1, 3, 1, h, w), the bucket (w, h)) of an image file."""
    image = Image.open(io.BytesIO(data))
    if image.mode not in ("RGB", "RGBA"):
        image = image.convert("RGB")
    bucket = BucketSelector(resolution).get_bucket_resolution(image.size)
    content = musubi_resize(image, bucket)[..., :3]
    contents = torch.from_numpy(np.ascontiguousarray(content))[None].permute(0, 3, 1, 2).unsqueeze(2)
    return contents / 127.5 - 1.0, bucket


@torch.no_grad()
def musubi_latents(vae: Any, contents: torch.Tensor) -> torch.Tensor:
    """Its ``encode_pixels_to_latents`` on contents cast to the VAE's dtype: (C, 1, h, w)."""
    latents = vae.encode(contents.to(vae.dtype)).latent_dist.mode()
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    return ((latents - mean) * inv_std)[0]


@torch.no_grad()
def musubi_text(tokenizer: Any, vlm: Any, caption: str) -> torch.Tensor:
    """Its ``get_qwen_prompt_embeds`` of one caption, then ``embed_i[:txt_len]``."""
    txt = [TEMPLATE.format(caption)]
    tokens = tokenizer(txt, max_length=MUSUBI_TEXT_MAX + DROP_INDEX, padding=True, truncation=True, return_tensors="pt")
    hidden = vlm(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
    states = hidden.hidden_states[-1]
    mask = tokens.attention_mask.bool()
    split = torch.split(states[mask], mask.sum(dim=1).tolist(), dim=0)
    rows = [e[DROP_INDEX:] for e in split]
    longest = max(e.size(0) for e in rows)
    embeds = torch.stack([torch.cat([u, u.new_zeros(longest - u.size(0), u.size(1))]) for u in rows]).to(vlm.dtype)
    masks = torch.stack([torch.cat([torch.ones(u.size(0)), torch.zeros(longest - u.size(0))]) for u in rows])
    return embeds[0][: int(masks[0].bool().sum())]


def released_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's saved Qwen2.5-VL names → the released checkpoint's (``model.layers.*``, ``visual.*``)."""
    renamed = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("model.visual."):
            key = key.removeprefix("model.")
        renamed[key] = value
    return renamed


def diffsynth_pipeline(snapshot: Path, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Its ``QwenImagePipeline`` on the CPU with the snapshot's VAE, text encoder and tokenizer (its own classes)."""
    diffsynth_ref.diffsynth()  # its wheel on the path
    from diffsynth.models import qwen_image_text_encoder, qwen_image_vae  # noqa: PLC0415 - from the wheel
    from diffsynth.pipelines.qwen_image import QwenImagePipeline  # noqa: PLC0415
    from diffsynth.utils.state_dict_converters.qwen_image_text_encoder import (  # noqa: PLC0415
        QwenImageTextEncoderStateDictConverter,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2Tokenizer  # noqa: PLC0415

    cfg = read_json(snapshot / "vae" / "config.json")
    vae = qwen_image_vae.QwenImageVAE(
        base_dim=cfg["base_dim"], z_dim=cfg["z_dim"], dim_mult=cfg["dim_mult"], num_res_blocks=cfg["num_res_blocks"]
    )
    vae.load_state_dict(load_file(snapshot / "vae" / "diffusion_pytorch_model.safetensors"), strict=True)
    config = Qwen2_5_VLConfig.from_pretrained(snapshot / "text_encoder")
    encoder = qwen_image_text_encoder.QwenImageTextEncoder.__new__(qwen_image_text_encoder.QwenImageTextEncoder)
    torch.nn.Module.__init__(encoder)  # its __init__ builds the 7B config: the attributes it sets, at the tiny size
    encoder.model = Qwen2_5_VLModel(config)
    encoder.lm_head = torch.nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
    encoder.config = config
    state = released_names(load_file(snapshot / "text_encoder" / "model.safetensors"))
    encoder.load_state_dict(QwenImageTextEncoderStateDictConverter(state), strict=True)
    pipe = QwenImagePipeline(device="cpu", torch_dtype=dtype)
    pipe.vae, pipe.text_encoder = vae.to(dtype).eval(), encoder.to(dtype).eval()
    pipe.tokenizer = Qwen2Tokenizer.from_pretrained(snapshot / "tokenizer")
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


def diffsynth_image(data: bytes, height: int, width: int) -> Image.Image:
    """Its ``LoadImage`` (``convert("RGB")``) and ``ImageCropAndResize(height, width, None, 16, 16)``."""
    diffsynth_ref.diffsynth()
    from diffsynth.core.data.operators import ImageCropAndResize  # noqa: PLC0415 - from the wheel

    return ImageCropAndResize(height, width, None, 16, 16)(Image.open(io.BytesIO(data)).convert("RGB"))


@torch.no_grad()
def diffsynth_data_process(pipe: Any, image: Image.Image, caption: str) -> tuple[dict, dict, dict]:
    """What its ``--task sft:data_process`` saves for one image: its training script's inputs, transferred as its
    training module does, through the units that need no DiT's gradient, by its unit runner."""
    shared = {
        "cfg_scale": 1,
        "rand_device": "cpu",
        "use_gradient_checkpointing": True,
        "use_gradient_checkpointing_offload": False,
        "edit_image_auto_resize": True,
        "zero_cond_t": False,
        "input_image": image,
        "height": image.size[1],
        "width": image.size[0],
    }
    trainer = diffsynth_ref.diffsynth().training_module.DiffusionTrainingModule()
    inputs = trainer.transfer_data_to_device(
        (shared, {"prompt": caption}, {"negative_prompt": ""}), "cpu", pipe.torch_dtype
    )
    for unit in pipe.split_pipeline_units(["dit"])[1]:
        inputs = pipe.unit_runner(unit, pipe, *inputs)
    return inputs


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float((a.float() - b.float()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(4.0 / mse)
