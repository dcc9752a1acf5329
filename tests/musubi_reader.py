"""A reader that follows musubi-tuner's training loader (Wan's, and HunyuanVideo 1.5's: ``architecture="hv15"``, whose
files end ``_hv15.safetensors`` and whose image buckets carry no FramePack window), for tests. musubi-tuner is not on
PyPI, so its rules are restated here from kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7
(``src/musubi_tuner/``):

* ``dataset/config_utils.py``: each ``[[datasets]]`` entry over ``[general]``; an entry naming ``video_directory``
  or ``video_jsonl_file`` is a video dataset, else an image dataset; ``resolution`` an int or ``[W, H]``;
  ``enable_bucket`` and ``bucket_no_upscale`` default false; two datasets with one cache directory: ValueError;
* ``dataset/image_video_dataset.py`` ``prepare_for_training``: ``glob(cache_directory/*_wan.safetensors)``; the base
  name split on ``_``; a video file: ``tokens[-2]`` is the image size ``WxH``, ``tokens[-3]`` ``start-frames``, the
  item key ``"_".join(tokens[:-3])`` (an image file: ``tokens[:-2]``); its text file
  ``{cache_directory}/{item_key}_wan_te.safetensors``, or the latent file is skipped with a warning; the bucket
  ``BucketSelector(resolution, enable_bucket, bucket_no_upscale).get_bucket_resolution(image size)``, with the frame
  count for a video (with Wan's ``fp_latent_window_size``, 9, for an image); ``num_repeats`` copies per item;
* ``dataset/bucket.py``: ``BucketSelector`` (step 16 for Wan) and ``BucketBatchManager``: buckets in sorted order,
  ``ceil(n / batch_size)`` batches each; a batch loads every item's latent and text file with safetensors
  ``load_file``, names each key as its content (``varlen_`` dropped, the dtype suffix dropped, a ``latents_*`` key's
  ``FxHxW`` dropped), stacks every non-varlen key (``torch.stack``: items of one batch must have one shape) and keeps
  the varlen ones (``t5``) as lists.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

ARCHITECTURE = "wan"
RESOLUTION_STEPS_WAN = 16
FP_LATENT_WINDOW_SIZE = 9  # ImageDatasetParams' default, appended to a Wan image bucket
_DTYPES = ("bfloat16", "float16", "float32", "int32", "int64")


def divisible_by(num: int, divisor: int) -> int:
    return num - num % divisor


class BucketSelector:
    """``dataset/bucket.py`` ``BucketSelector`` for Wan."""

    def __init__(self, resolution: tuple[int, int], enable_bucket: bool = True, no_upscale: bool = False) -> None:
        self.bucket_area = resolution[0] * resolution[1]
        self.reso_steps = RESOLUTION_STEPS_WAN
        if not enable_bucket:
            self.bucket_resolutions, self.no_upscale = [resolution], False
        else:
            self.no_upscale = no_upscale
            sqrt_size = int(math.sqrt(self.bucket_area))
            min_size = divisible_by(sqrt_size // 2, self.reso_steps)
            found = []
            for w in range(min_size, sqrt_size + self.reso_steps, self.reso_steps):
                h = divisible_by(self.bucket_area // w, self.reso_steps)
                found += [(w, h), (h, w)]
            self.bucket_resolutions = sorted(set(found))
        self.aspect_ratios = np.array([w / h for w, h in self.bucket_resolutions])

    def get_bucket_resolution(self, image_size: tuple[int, int]) -> tuple[int, int]:
        if self.no_upscale and image_size[0] * image_size[1] <= self.bucket_area:
            return divisible_by(image_size[0], self.reso_steps), divisible_by(image_size[1], self.reso_steps)
        bucket_id = np.abs(self.aspect_ratios - image_size[0] / image_size[1]).argmin()
        return self.bucket_resolutions[bucket_id]


@dataclass
class Item:
    item_key: str
    image_size: tuple[int, int]
    bucket: tuple[Any, ...]
    latent_cache_path: str
    text_encoder_output_cache_path: str


def remove_dtype_suffix(name: str) -> str:
    for dtype in _DTYPES:
        if name.endswith("_" + dtype):
            return name[: -len(dtype) - 1]
    return name


class MusubiDataset:
    """One ``[[datasets]]`` entry, prepared for training: ``len()`` batches, ``[i]`` a batch dict, ``items``
    (`architecture`: the code of the training script's architecture, ``wan`` or ``hv15``: its files' suffix)."""

    def __init__(self, params: dict[str, Any], architecture: str = ARCHITECTURE) -> None:
        self.params, self.architecture = params, architecture
        self.video = "video_directory" in params or "video_jsonl_file" in params
        resolution = params.get("resolution", (960, 544))
        self.resolution = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
        self.batch_size, self.num_repeats = params.get("batch_size", 1), params.get("num_repeats", 1)
        enable, no_upscale = params.get("enable_bucket", False), params.get("bucket_no_upscale", False)
        self.selector = BucketSelector(self.resolution, enable, no_upscale and enable)
        self.cache_directory = params["cache_directory"]
        # the architecture code (``wan``; ``qi``: Qwen-Image, ``hv15``: HunyuanVideo 1.5, whose image buckets are
        # (W, H) alone: ``ImageDataset.prepare_for_training`` adds the latent window for Wan and FramePack only)
        self.buckets: dict[tuple[Any, ...], list[Item]] = {}
        pattern = os.path.join(self.cache_directory, f"*_{self.architecture}.safetensors")  # noqa: PTH118
        for cache_file in glob.glob(pattern):
            item = self._item(cache_file)
            if item is not None:
                self.buckets.setdefault(item.bucket, []).extend([item] * self.num_repeats)
        counts = {reso: math.ceil(len(items) / self.batch_size) for reso, items in self.buckets.items()}
        self.batches = [(reso, i) for reso in sorted(self.buckets) for i in range(counts[reso])]

    def _item(self, cache_file: str) -> Item | None:
        tokens = os.path.basename(cache_file).split("_")  # noqa: PTH119
        width, height = map(int, tokens[-2].split("x"))
        key_end = -3 if self.video else -2
        item_key = "_".join(tokens[:key_end])
        text_file = os.path.join(self.cache_directory, f"{item_key}_{self.architecture}_te.safetensors")  # noqa: PTH118
        if not os.path.exists(text_file):  # noqa: PTH110
            logger.warning("Text encoder output cache file not found: %s", text_file)
            return None
        bucket = self.selector.get_bucket_resolution((width, height))
        if self.video:  # its frames
            bucket = (*bucket, int(tokens[-3].split("-")[1]))
        elif self.architecture == ARCHITECTURE:  # Wan's image window (HunyuanVideo 1.5's image buckets have none)
            bucket = (*bucket, FP_LATENT_WINDOW_SIZE)
        return Item(item_key, (width, height), bucket, cache_file, text_file)

    @property
    def items(self) -> list[Item]:
        return [item for reso in sorted(self.buckets) for item in self.buckets[reso]]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Any]:
        reso, batch = self.batches[index]
        bucket = self.buckets[reso]
        data: dict[str, list[torch.Tensor]] = {}
        varlen: set[str] = set()
        for item in bucket[batch * self.batch_size : (batch + 1) * self.batch_size]:
            stored = {**load_file(item.latent_cache_path), **load_file(item.text_encoder_output_cache_path)}
            for key, tensor in stored.items():
                content = key.removeprefix("varlen_")
                if not content.endswith("_mask"):
                    content = remove_dtype_suffix(content)
                    if content.startswith("latents_"):
                        content = content.rsplit("_", 1)[0]
                data.setdefault(content, []).append(tensor)
                if key.startswith("varlen_"):
                    varlen.add(content)
        return {k: v if k in varlen else torch.stack(v) for k, v in data.items()}


def load_dataset_config(path: Path, architecture: str = ARCHITECTURE, **overrides: Any) -> list[MusubiDataset]:
    """The datasets of a dataset config (`overrides` over every entry, as a user edits the file), as the training
    script of `architecture` reads them."""
    config = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    entries = [{**config.get("general", {}), **entry, **overrides} for entry in config.get("datasets", [])]
    directories = [entry.get("cache_directory") for entry in entries]
    if len(set(directories)) != len(directories):
        raise ValueError("cache directory should be unique for each dataset")
    return [MusubiDataset(entry, architecture) for entry in entries]
