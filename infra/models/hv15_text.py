"""HunyuanVideo 1.5's text conditioning as musubi-tuner caches it: the prompt in the video template through
Qwen2.5-VL (its 3rd last hidden state, the template's system part cropped), and the quoted text of the prompt through
the ByT5 glyph encoder.

Restated from kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7,
``src/musubi_tuner/hunyuan_video_1_5/hunyuan_video_1_5_text_encoder.py`` (``get_qwen_tokens``,
``get_qwen_prompt_embeds_from_tokens``, ``get_byt5_text_tokens``, ``get_byt5_prompt_embeds_from_tokens``) and
``hv_1_5_cache_text_encoder_outputs.py`` (``encode_and_save_batch``):

* the prompt goes into `PROMPT_TEMPLATE` as a plain string (no chat template); the crop index is found once from the
  tokenizer: the position after the tokens of ``"<|im_start|>user\\n"`` in the template filled with
  ``"a photo of a cat"``; the prompt is tokenized with ``max_length = 1024 + crop``, truncated on the right, padded
  to the longest of its batch (latentforge encodes each prompt alone: musubi's ``--batch_size 1``, and no row
  depends on another prompt);
* the Qwen2.5-VL forward runs under autocast in the model's dtype; ``hidden_states[-3][:, crop:]`` is kept, and the
  cache stores its first ``mask.sum()`` rows (``varlen_vl_embed``);
* the glyph text: every ``"..."`` match, then every ``“...”`` match (in that order, repeats kept), each written
  ``Text "{t}". `` one after the other; none (or an empty prompt): no glyph rows at all; else ByT5 tokens padded to
  128 with the attention mask, ByT5 in float16 under float16 autocast (musubi loads it so), and the cache stores the
  rows of the mask (``varlen_byt5_embed``).

diffusers' HunyuanVideo15Pipeline differs (a chat template whose system message holds the source's indentation,
crop 108, 1000 tokens, glyph texts in order of appearance without repeats, 256 glyph tokens): latentforge follows the
consumer that caches these tensors, musubi-tuner.
"""

from __future__ import annotations

import re

import torch

#: musubi's ``PROMPT_TEMPLATE_VIDEO`` (HunyuanVideo 1.5's video template), byte for byte.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant. Describe the video by detailing the following aspects: \n"
    "1. The main content and theme of the video. \n"
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \n"
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \n"
    "4. background environment, light, style and atmosphere. \n"
    "5. camera angles, movements, and transitions used in the video.<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
#: The prompt musubi fills the template with to find the crop index, and the marker it looks for.
CROP_PROBE = "a photo of a cat"
CROP_MARKER = "<|im_start|>user\n"
#: musubi's TOKENIZER_MAX_LENGTH (the tokens kept after the crop) and BYT5_MAX_LENGTH.
MAX_LENGTH = 1024
GLYPH_MAX_LENGTH = 128
#: The hidden state musubi keeps ("the 3rd last layer's hidden states for HunyuanVideo 1.5").
HIDDEN_STATE = -3
#: What the spec records as the text stage (its fingerprint's ``text_encoder_output``).
TEXT_STAGE = "hidden_states[-3]"
#: ByT5's compute and stored dtype in musubi's caching (``load_byt5(..., dtype=torch.float16)``).
GLYPH_DTYPE = torch.float16
_QUOTED = re.compile(r"\"(.*?)\"")
_QUOTED_CJK = re.compile(r"“(.*?)”")
#: Qwen2's pre-tokenizer regex (transformers' ``tokenization_qwen2.PRETOKENIZE_REGEX``), for the tiny tokenizer.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


def crop_start(tokenizer: object) -> int:
    """The number of template tokens musubi drops from the front (its ``PROMPT_TEMPLATE_VIDEO_CROP_START_IDX``)."""
    probe = tokenizer(PROMPT_TEMPLATE.format(CROP_PROBE), truncation=False).input_ids  # type: ignore[operator]
    marker = tokenizer(CROP_MARKER, add_special_tokens=False).input_ids  # type: ignore[operator]
    for start in range(len(probe) - len(marker) + 1):
        if probe[start : start + len(marker)] == marker:
            return start + len(marker)
    raise ValueError(f"the tokenizer does not find {CROP_MARKER!r} in the HunyuanVideo 1.5 prompt template")


def glyph_text(prompt: str) -> str | None:
    """The glyph encoder's input for `prompt` (musubi's ``get_byt5_text_tokens`` + ``format_prompt``), or None."""
    if not prompt:
        return None
    texts = _QUOTED.findall(prompt) + _QUOTED_CJK.findall(prompt)
    if not texts:
        return None
    return "".join(f'Text "{text}". ' for text in texts)


def autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """musubi's ``torch.autocast(device_type, dtype=<the model's dtype>)``; float32 has no autocast (off)."""
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)
