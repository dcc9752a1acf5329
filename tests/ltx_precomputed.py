"""A reader that follows the LTX-2 trainer's ``PrecomputedDataset`` rules, for tests (ltx-trainer is not on PyPI:
its rules are restated here from ``packages/ltx-trainer/src/ltx_trainer/datasets.py`` of Lightricks/LTX-2 at
commit 400fd31, and the sources its strategies ask for from ``training_strategies/``).

The rules, in the trainer's order:

* the data root is ``Path(root).expanduser().resolve()``, or its ``.precomputed/`` where that exists;
* ``data_sources``: a dict directory → output key, a list (key = directory), or None (``{"latents":
  "latent_conditions", "conditions": "text_conditions"}``); every source directory must exist
  (FileNotFoundError naming it);
* the primary source is ``latents`` where listed, else the first; its files are ``glob("**/*.pt")``, sorted
  (as Paths); a primary file is a sample only when every other source has a file at the same relative path
  (``conditions/condition_X.pt`` for a legacy ``latent_X.pt``); the others are dropped with one info line;
* no primary file: ValueError; no sample, or different counts per output key: ValueError;
* an item loads each source with ``torch.load(map_location="cpu", weights_only=True)``; a source whose directory
  name contains ``latent`` has a legacy 2-D ``[F*H*W, C]`` ``latents`` unpatchified to ``[C, F, H, W]``
  (``einops`` ``"(f h w) c -> c f h w"``, here the same reshape in torch); the item also carries ``idx``.

`t2v_sources` is ``TextToVideoConfig.get_data_sources``: what ``train.py`` passes for text-to-video (with audio:
``audio_latents/`` too, so a clip without an audio track is not trained on).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PRECOMPUTED_DIR_NAME = ".precomputed"


def t2v_sources(with_audio: bool = False, audio_latents_dir: str = "audio_latents") -> dict[str, str]:
    """The text-to-video strategy's ``get_data_sources()``."""
    sources = {"latents": "latents", "conditions": "conditions"}
    if with_audio:
        sources[audio_latents_dir] = "audio_latents"
    return sources


class PrecomputedReader:
    """``PrecomputedDataset(data_root, data_sources)``: ``len()``, ``[i]`` (a dict output key → the loaded record,
    plus ``idx``), and `relative_paths` (each sample's path under the primary source, in order)."""

    def __init__(self, data_root: str | Path, data_sources: dict[str, str] | list[str] | None = None) -> None:
        root = Path(data_root).expanduser().resolve()
        if not root.exists():
            raise FileNotFoundError(f"Data root directory does not exist: {root}")
        self.data_root = root / PRECOMPUTED_DIR_NAME if (root / PRECOMPUTED_DIR_NAME).exists() else root
        if data_sources is None:
            data_sources = {"latents": "latent_conditions", "conditions": "text_conditions"}
        elif isinstance(data_sources, list):
            data_sources = {source: source for source in data_sources}
        self.data_sources = dict(data_sources)
        self.source_paths = {name: self.data_root / name for name in self.data_sources}
        for name, path in self.source_paths.items():
            if not path.exists():
                raise FileNotFoundError(f"Required {name} directory does not exist: {path}")
        self.sample_files = self._discover()
        counts = {key: len(files) for key, files in self.sample_files.items()}
        if not counts or all(count == 0 for count in counts.values()):
            raise ValueError(f"No valid samples found in {self.data_root} (per-source counts: {counts})")
        if len(set(counts.values())) > 1:
            raise ValueError(f"Mismatched sample counts across sources: {counts}")

    def _expected(self, name: str, data_file: Path, rel: Path) -> Path:
        if name == "conditions" and data_file.name.startswith("latent_"):  # the trainer's legacy naming
            return self.source_paths[name] / f"condition_{data_file.stem[7:]}.pt"
        return self.source_paths[name] / rel

    def _discover(self) -> dict[str, list[Path]]:
        primary = "latents" if "latents" in self.data_sources else next(iter(self.data_sources))
        found = {name: {str(p) for p in path.glob("**/*.pt")} for name, path in self.source_paths.items()}
        data_files = sorted(self.source_paths[primary].glob("**/*.pt"))
        if not data_files:
            raise ValueError(f"No data files found in {self.source_paths[primary]}")
        samples: dict[str, list[Path]] = {key: [] for key in self.data_sources.values()}
        kept = 0
        for data_file in data_files:
            rel = data_file.relative_to(self.source_paths[primary])
            others = (name for name in self.data_sources if name != primary)
            if all(str(self._expected(name, data_file, rel)) in found[name] for name in others):
                for name, key in self.data_sources.items():
                    samples[key].append(self._expected(name, data_file, rel).relative_to(self.source_paths[name]))
                kept += 1
        if kept < len(data_files):
            logger.info("Skipped %d invalid samples from %d total", len(data_files) - kept, len(data_files))
        return samples

    @property
    def relative_paths(self) -> list[str]:
        """Each sample's file path under its first source, as posix strings, in the reader's order."""
        return [p.as_posix() for p in next(iter(self.sample_files.values()))]

    def __len__(self) -> int:
        return len(next(iter(self.sample_files.values())))

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {}
        for name, key in self.data_sources.items():
            path = self.source_paths[name] / self.sample_files[key][index]
            data = torch.load(path, map_location="cpu", weights_only=True)
            if "latent" in name.lower():
                data = _unpatchify(data)
            item[key] = data
        item["idx"] = index
        return item


def _unpatchify(data: dict[str, Any]) -> dict[str, Any]:
    """A legacy patchified ``[F*H*W, C]`` ``latents`` → ``[C, F, H, W]`` (the trainer's
    ``_normalize_video_latents``); any other record as it is."""
    latents = data["latents"]
    if latents.dim() != 2:
        return data
    f, h, w = data["num_frames"], data["height"], data["width"]
    return {**data, "latents": latents.reshape(f, h, w, latents.shape[1]).permute(3, 0, 1, 2)}
