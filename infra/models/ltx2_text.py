"""LTX-2's text side that differs by version: which version a snapshot is, its Gemma (3, or 4 for LTX-2.5) loaded
in the compute dtype or in 8-bit, and prompts tokenized as the LTX-2 trainer tokenizes them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infra.errors import ConfigError
from infra.models.base import read_json

#: The text encoder classes diffusers' LTX2Pipeline takes, by the ``model_type`` of ``text_encoder/config.json``.
TEXT_ENCODERS = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4_unified": "Gemma4UnifiedForConditionalGeneration"}
#: The LTX-2 version of a Gemma 4 text encoder (2.0 and 2.3 share Gemma 3; their connectors tell them apart).
GEMMA4_VERSION = "2.5"
#: Versions detected before `CacheSpec.model_version` existed: recorded as None, so their caches keep fingerprints.
UNRECORDED_VERSIONS = ("2.0", "2.3")


def text_encoder_type(model_dir: Path) -> str:
    """The ``model_type`` of the snapshot's text encoder; ConfigError for one LTX2Pipeline does not take."""
    model_type = str(read_json(model_dir / "text_encoder" / "config.json").get("model_type"))
    if model_type not in TEXT_ENCODERS:
        raise ConfigError(
            f"{model_dir}/text_encoder: model_type {model_type!r}; LTX-2 encodes with "
            + " or ".join(f"{cls} ({kind})" for kind, cls in TEXT_ENCODERS.items())
        )
    return model_type


def ltx2_version(model_dir: Path) -> str:
    """2.5 for a Gemma 4 text encoder; else 2.3 where the connectors project per modality (2.3's feature extractor);
    else 2.0."""
    if text_encoder_type(model_dir) == "gemma4_unified":
        return GEMMA4_VERSION
    connectors = read_json(model_dir / "connectors" / "config.json")
    return "2.3" if connectors.get("per_modality_projections") else "2.0"


def load_gemma(model_dir: Path, device: torch.device, dtype: torch.dtype, in_8bit: bool = False) -> torch.nn.Module:
    """The snapshot's Gemma (`TEXT_ENCODERS`) on `device`, in eval mode; `in_8bit`: quantized by bitsandbytes as it
    loads (CUDA only)."""
    import transformers  # noqa: PLC0415 - heavy import, only when loading

    model_class = getattr(transformers, TEXT_ENCODERS[text_encoder_type(model_dir)])
    path = model_dir / "text_encoder"
    if not in_8bit:
        model = model_class.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
        return model.to(device).eval()
    if device.type != "cuda":
        raise ConfigError(f"--load-text-encoder-in-8bit: bitsandbytes' 8-bit Gemma runs on CUDA, not {device}")
    # LLM.int8() with its default outlier threshold (6.0), lm_head kept in full precision: what the trainer's
    # ltx_trainer.gemma_8bit does by hand; bitsandbytes quantizes each Linear as it is moved onto the GPU
    model = model_class.from_pretrained(
        path,
        torch_dtype=dtype,
        quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True),
        device_map={"": torch.cuda.current_device() if device.index is None else device.index},
        local_files_only=True,
    )
    return model.eval()


def trainer_tokens(tokenizer: Any, prompts: Sequence[str], max_length: int) -> tuple[Any, list[int]]:
    """ltx-core's ``LTXGemmaTokenizer``: the stripped prompt truncated to max_length, ``<bos>`` prepended where the
    tokenizer did not put one (Gemma 4's does not; Gemma 3's does) and the result cut to max_length again, padded
    to max_length on the tokenizer's side (left). Returns the padded batch and each prompt's untruncated count."""
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ConfigError("the LTX-2 tokenizer has no bos_token: LTX-2 prompts begin with <bos>")

    def with_bos(ids: list[int]) -> list[int]:
        return ids if ids and ids[0] == bos else [bos, *ids]

    stripped = [prompt.strip() for prompt in prompts]
    cut = tokenizer(stripped, padding=False, truncation=True, max_length=max_length).input_ids
    rows = [with_bos(ids)[:max_length] for ids in cut]
    padded = tokenizer.pad({"input_ids": rows}, padding="max_length", max_length=max_length, return_tensors="pt")
    totals = [len(with_bos(ids)) for ids in tokenizer(stripped, truncation=False).input_ids]
    return padded, totals
