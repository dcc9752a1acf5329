"""DiffSynth-Studio's split-training cache, ``diffsynth``: one ``.pth`` per sample, what its ``--task
sft:data_process`` saves for a Wan model and its ``--task sft:train`` reads back.

Restated from the ``diffsynth`` 2.1.12 package (``diffusion/runner.py`` ``launch_data_process_task``: ``torch.save``
of the tuple ``(inputs_shared, inputs_posi, inputs_nega)`` the pipeline units leave; ``core/data/unified_dataset.py``:
with no metadata file, every ``.pth`` under the base path, recursively, loaded with ``torch.load(weights_only=False)``;
``pipelines/wan_video.py``: the units) and ``examples/wanvideo/model_training/train.py`` of modelscope/DiffSynth-Studio
at commit fed7b18fac2ed4cb802796eec91970e7659bccde (the inputs it starts from):

* ``inputs_shared``: ``height``, ``width``, ``num_frames`` (pixels), ``cfg_scale`` 1, ``tiled`` False,
  ``use_gradient_checkpointing`` True (its trainer forces it, and split training reads it from here),
  ``use_gradient_checkpointing_offload`` False, ``cfg_merge`` False, ``vace_scale`` 1, ``max_timestep_boundary``
  and ``min_timestep_boundary`` (1.0 and 0.0 unless ``--max/--min-timestep-boundary``: its loss draws the timestep
  from that range, as the file says), ``input_latents`` [1, C, F', H', W']; I2V: ``y`` [1, 20, F', H', W'] and, with a
  CLIP, ``clip_feature`` [1, 257, 1280]; TI2V-5B: ``fuse_vae_embedding_in_latents`` True and ``first_frame_latents``
  [1, 48, 1, H', W']; the None its VACE and Animate units leave; and ``latentforge``: the fingerprint, group and id (its
  model function takes unknown keys and ignores them);
* ``inputs_posi``: ``prompt``, ``context`` [1, 512, D] zero past the prompt; ``inputs_nega``: the same ``context``
  (with ``cfg_scale`` 1 its unit runner copies the positive side);
* tensors bf16 (its trainer's ``torch_dtype``). Not stored, of what its data_process saves: ``input_video`` and
  ``input_image`` (PIL images), ``noise`` and ``latents`` (random; the training step draws its own), ``rand_device``.

Files are ``OUT/<stem>.pth`` (its own are ``{process_index}/{data_id}.pth``: its reader takes any name). They are
pickles its trainer loads with ``weights_only=False``; latentforge reads them only with ``weights_only=True`` (a tuple
of dicts of tensors, numbers and strings loads that way).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.formats.base import (
    CLIP_KIND,
    FIRST_FRAME_KIND,
    IMAGE_LATENTS_KIND,
    EncodedSample,
    Format,
    PerSampleWriter,
    opened,
)
from infra.formats.consumer_glob import ConsumerGlob
from infra.outdir import OutFile

#: What a file carries for latentforge (its fingerprint, the sample's group and id), under one key of inputs_shared.
MARKS_KEY = "latentforge"
STORED = torch.bfloat16
#: What ``get_pipeline_inputs`` of its Wan training script sets, that the training step reads back from the file.
TRAINING_INPUTS: dict[str, Any] = {
    "cfg_scale": 1,
    "tiled": False,
    "use_gradient_checkpointing": True,
    "use_gradient_checkpointing_offload": False,
    "cfg_merge": False,
    "vace_scale": 1,
}
#: Keys its VACE and Animate units set to None for a sample without their inputs: kept, as its data_process keeps them.
NONE_KEYS = ("vace_context", "animate_pose_video", "animate_face_video", "animate_inpaint_video", "animate_mask_video")
#: Output kind → its key in ``inputs_shared`` / ``inputs_posi``.
KEYS: dict[str, str] = {
    "latents": "input_latents",
    "text_embeddings": "context",
    IMAGE_LATENTS_KIND: "y",
    CLIP_KIND: "clip_feature",
    FIRST_FRAME_KIND: "first_frame_latents",
}


def _batched(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(STORED).unsqueeze(0).contiguous()


def inputs(
    sample: EncodedSample, boundaries: tuple[float, float] = (1.0, 0.0)
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The tuple its data_process step would save for the sample (`boundaries`: its ``--max_timestep_boundary`` and
    ``--min_timestep_boundary``, which its training step reads from the file)."""
    assert sample.latents is not None and sample.text_embeds is not None
    frames, height, width = sample.info["geometry"]
    shared: dict[str, Any] = {"height": int(height), "width": int(width), "num_frames": int(frames)}
    shared |= TRAINING_INPUTS | {"max_timestep_boundary": boundaries[0], "min_timestep_boundary": boundaries[1]}
    shared |= {"input_latents": _batched(sample.latents)} | dict.fromkeys(NONE_KEYS)
    for kind in (IMAGE_LATENTS_KIND, CLIP_KIND, FIRST_FRAME_KIND):
        if isinstance(tensor := sample.extras.get(kind), torch.Tensor):
            shared[KEYS[kind]] = _batched(tensor)
    if FIRST_FRAME_KIND in sample.extras:
        shared["fuse_vae_embedding_in_latents"] = True
    shared[MARKS_KEY] = {"fingerprint": sample.fingerprint, "group": sample.group, "id": sample.id}
    context = _batched(sample.text_embeds)
    return shared, {"prompt": sample.prompt, "context": context}, {"context": context}


class DiffSynthWriter(PerSampleWriter):
    """Writes ``OUT/<stem>.pth``, one file holding every output kind."""

    #: (max, min) timestep boundaries the files carry (the spec's).
    boundaries: tuple[float, float] = (1.0, 0.0)

    def render(self, sample: EncodedSample) -> list[tuple[list[str], str, bytes]]:
        buffer = io.BytesIO()
        torch.save(inputs(sample, self.boundaries), buffer)
        return [([], f"{sample.stem}.pth", buffer.getvalue())]


class DiffSynthFormat(Format):
    """The diffsynth format: DiffSynth-Studio's split-training ``.pth`` files."""

    name = "diffsynth"
    keys: ClassVar[dict[str, str]] = KEYS
    has_fingerprint = True
    #: Its ``UnifiedDataset.search_for_cached_data_files``: every name ending ``.pth`` below the base path, hidden ones
    #: and folders through links included, each unpickled (``weights_only=False``).
    consumer_glob = ConsumerGlob(("**/*.pth",))

    def __init__(self, families: dict[str, Format] | None = None) -> None:
        #: family → the format object for its pipeline's inputs (`infra.formats.diffsynth_qwen`); others: Wan's
        self.families = dict(families or {})

    def for_family(self, family: str | None) -> Format:
        return self.families.get(family or "", self)

    def writer(self, out: Path) -> DiffSynthWriter:
        return DiffSynthWriter(out, self)

    def open_writer(self, out: Path, spec: Any, shard_id: str) -> DiffSynthWriter:
        writer = self.writer(out)
        if spec is not None:
            writer.boundaries = (float(spec.max_timestep_boundary), float(spec.min_timestep_boundary))
        return writer

    def stored_dtype(self, kind: str, store_dtype: str) -> torch.dtype:
        return STORED

    def paths(self, stem: str, kinds: Iterable[str]) -> dict[str, str]:
        return dict.fromkeys(kinds, f"{stem}.pth")

    def read(self, path: Path | OutFile) -> dict[str, Any]:
        """The file's positive and shared inputs in one dict (as its training step passes them), the tensors of the
        output kinds without DiffSynth's batch dimension, its marks; loaded with ``weights_only=True`` only."""
        with opened(path) as fh:
            shared, posi, _ = torch.load(fh, map_location="cpu", weights_only=True)
        record = {**shared, **posi}
        for key in KEYS.values():
            if isinstance(record.get(key), torch.Tensor):
                record[key] = record[key][0]
        return record | dict(shared.get(MARKS_KEY) or {})
