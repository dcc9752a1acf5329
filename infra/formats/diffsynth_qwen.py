"""DiffSynth-Studio's split-training cache for Qwen-Image, ``--format diffsynth`` with family qwen-image: one ``.pth``
per image, what its ``--task sft:data_process`` saves for ``QwenImagePipeline`` and its ``--task sft:train`` reads.

Restated from the ``diffsynth`` 2.1.12 package (``pipelines/qwen_image.py``: the units its data_process runs, all of
them for a LoRA on ``dit``: ``QwenImageUnit_InputImageEmbedder`` → ``input_latents``, ``QwenImageUnit_PromptEmbedder``
→ ``prompt_emb`` and ``prompt_emb_mask``, the others leaving nothing for an image without edit, context, layer or
ControlNet inputs; ``diffusion/loss.py`` ``FlowMatchSFTLoss``; ``diffusion/base_pipeline.py``: with ``cfg_scale`` 1
the negative side takes the positive side's outputs) and ``examples/qwen_image/model_training/train.py`` of
modelscope/DiffSynth-Studio at commit fed7b18fac2ed4cb802796eec91970e7659bccde (``get_pipeline_inputs``):

* ``inputs_shared``: ``height``, ``width`` (pixels), ``cfg_scale`` 1, ``use_gradient_checkpointing`` True,
  ``use_gradient_checkpointing_offload`` False, ``edit_image_auto_resize`` True, ``zero_cond_t`` False,
  ``input_latents`` [1, 16, H/8, W/8] (its ``QwenImageVAE.encode``: the frame axis dropped, normalised); and
  ``latentforge``: the fingerprint, group and id (its model function takes unknown keys and ignores them);
* ``inputs_posi``: ``prompt``, ``prompt_emb`` [1, L, D] (the caption's rows past the template's 34: one caption has
  no padding), ``prompt_emb_mask`` [1, L] int64 ones; ``inputs_nega``: ``negative_prompt`` "" and the same two;
* float tensors bf16 (its trainer's ``torch_dtype``). Not stored, of what its data_process saves: ``input_image``
  (the PIL image), ``noise`` and ``latents`` (random; the training step draws its own), ``rand_device``.

Files are ``OUT/<stem>.pth``, loaded by latentforge only with ``weights_only=True``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.formats.base import EncodedSample, opened
from infra.formats.diffsynth import MARKS_KEY, STORED, DiffSynthFormat, DiffSynthWriter
from infra.outdir import OutFile

#: What its ``get_pipeline_inputs`` sets that the training step reads back from the file.
TRAINING_INPUTS: dict[str, Any] = {
    "cfg_scale": 1,
    "use_gradient_checkpointing": True,
    "use_gradient_checkpointing_offload": False,
    "edit_image_auto_resize": True,
    "zero_cond_t": False,
}
KEYS: dict[str, str] = {"latents": "input_latents", "text_embeddings": "prompt_emb"}


def inputs(sample: EncodedSample) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The tuple its data_process step would save for the image."""
    assert sample.latents is not None and sample.text_embeds is not None
    _, height, width = sample.info["geometry"]
    shared: dict[str, Any] = {"height": int(height), "width": int(width), **TRAINING_INPUTS}
    shared["input_latents"] = sample.latents[:, 0].to(STORED).unsqueeze(0).contiguous()  # its VAE drops the frame axis
    shared[MARKS_KEY] = {"fingerprint": sample.fingerprint, "group": sample.group, "id": sample.id}
    emb = sample.text_embeds[: sample.seq_len].to(STORED).unsqueeze(0).clone()  # its own storage: not the padded one
    text = {"prompt_emb": emb, "prompt_emb_mask": torch.ones((1, sample.seq_len), dtype=torch.int64)}
    return shared, {"prompt": sample.prompt, **text}, {"negative_prompt": "", **text}


class DiffSynthQwenWriter(DiffSynthWriter):
    """Writes ``OUT/<stem>.pth``, one file holding every output kind."""

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        buffer = io.BytesIO()
        torch.save(inputs(sample), buffer)
        return [([], f"{sample.stem}.pth", buffer.getvalue())]


class DiffSynthQwenFormat(DiffSynthFormat):
    """The diffsynth format for family qwen-image."""

    keys: ClassVar[dict[str, str]] = KEYS

    def writer(self, out: Path) -> DiffSynthQwenWriter:
        return DiffSynthQwenWriter(out, self)

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> DiffSynthQwenWriter:
        return self.writer(out)

    def trims_text_for(self, family: str) -> bool:
        return True  # one caption, no padding: its prompt_emb holds the caption's rows only

    def read(self, path: Path | OutFile) -> dict[str, Any]:
        """The file's positive and shared inputs in one dict, as its training step passes them, the output kinds in
        the family's layout (latents (C, 1, h, w): the frame axis its VAE drops put back; the caption's rows
        (L, D)), its marks; loaded with ``weights_only=True`` only."""
        with opened(path) as fh:
            shared, posi, _ = torch.load(fh, map_location="cpu", weights_only=True)
        record = {**shared, **posi}
        if isinstance(latents := record.get("input_latents"), torch.Tensor):
            record["input_latents"] = latents[0].unsqueeze(1)
        if isinstance(emb := record.get("prompt_emb"), torch.Tensor):
            record["prompt_emb"] = emb[0]
        return record | dict(shared.get(MARKS_KEY) or {})
