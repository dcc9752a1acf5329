"""``latentforge check-consumer OUT``: the cache read by its consumer's own released reader, where that reader is
importable here, every sample and one batch; otherwise one line naming the package it would use.

Readers run here: DiffSynth-Studio's (``diffsynth``: its ``UnifiedDataset`` over OUT, as its ``--task sft:train``
lists a split-training cache, each file through its own ``LoadTorchPickle``; its trainer's batch is one sample). Its
loader unpickles with ``weights_only=False``: every file is first read with ``weights_only=True`` by latentforge's own
reader, and one that needs more is reported, never handed to it. The other consumers (musubi-tuner, FastVideo, the
LTX-2 trainer) are named with the package they would need; their own readers are not run here yet.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infra.cache import ledger
from infra.cache.cachedir import read_cache_json
from infra.errors import ConfigError, DamagedCacheError
from infra.formats import get_format

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsumerReader:
    """A format's consumer: its name, the module its reader needs, how to install it, the check (None: named)."""

    consumer: str
    module: str
    install: str
    check: Callable[[Path, list[str]], str] | None = None


def _shape(value: Any) -> str:
    return "×".join(map(str, value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _diffsynth(out: Path, paths: list[str]) -> str:
    """Every ``.pth`` its ``UnifiedDataset`` finds under OUT is one the ledgers name, each loads through its own
    operator, and one batch (its trainer's: one sample) has the inputs its training step reads."""
    unified = importlib.import_module("diffsynth.core.data.unified_dataset")
    fmt = get_format("diffsynth", read_cache_json(out)["spec"].get("family"))  # its pipeline's input names
    latents, text = fmt.keys["latents"], fmt.keys["text_embeddings"]
    for path in paths:  # latentforge's own safe read first: nothing that needs more is unpickled below
        try:
            fmt.read(out / path)
        except (pickle.UnpicklingError, RuntimeError, ValueError, OSError, EOFError) as exc:
            raise DamagedCacheError(f"{path} does not load with weights_only=True: not handed to its loader "
                                    f"({type(exc).__name__})") from exc  # fmt: skip
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # it prints what it searched and found: the one line below says it
        dataset = unified.UnifiedDataset(base_path=str(out), metadata_path=None)
    logger.debug("its UnifiedDataset: %s", said.getvalue().strip())
    found = sorted(str(Path(p).relative_to(out)) for p in dataset.cached_data)
    if found != sorted(paths):
        extra, missing = sorted(set(found) - set(paths)), sorted(set(paths) - set(found))
        raise DamagedCacheError(f"its UnifiedDataset finds {len(found)} file(s), the ledgers {len(paths)} (extra: "
                                f"{extra[:3]}, missing: {missing[:3]})")  # fmt: skip
    for index in range(len(found)):
        shared, posi, _ = dataset[index]
        if not isinstance(shared.get(latents), torch.Tensor) or text not in posi:
            raise DamagedCacheError(f"{found[index]}: no {latents} or {text} where its training step reads them")
    shared, posi, _ = dataset[0]
    return f"{len(found)} sample(s) read; one batch: {latents} {_shape(shared[latents])}, {text} {_shape(posi[text])}"


#: format → its consumer's reader (`infra.formats.consumers` names the consumer; this says how to load it).
READERS: dict[str, ConsumerReader] = {
    "diffsynth": ConsumerReader("DiffSynth-Studio", "diffsynth", "pip install diffsynth", _diffsynth),
    "musubi": ConsumerReader(
        "musubi-tuner", "musubi_tuner", "not on PyPI: install kohya-ss/musubi-tuner from its repository"
    ),
    "parquet": ConsumerReader("FastVideo", "fastvideo", "pip install fastvideo"),
    "ltx": ConsumerReader("the LTX-2 trainer", "ltx_trainer", "not on PyPI: install Lightricks/LTX-2's ltx-trainer"),
}


@dataclass(frozen=True)
class ConsumerCheck:
    """What check-consumer found: ``ok`` (read by the consumer's own reader), and its one line."""

    ok: bool
    line: str


def check_consumer(out: Path) -> ConsumerCheck:
    """The cache at `out` read by its consumer's own reader (see the module). ConfigError for an OUT that is not a
    cache, or a format no outside consumer reads; DamagedCacheError (from its reader) for what it cannot read."""
    try:
        spec = read_cache_json(out)["spec"]
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ConfigError(f"{out} is not a latentforge cache ({exc})") from exc
    fmt = str(spec.get("format"))
    reader = READERS.get(fmt)
    if reader is None:
        raise ConfigError(f"format {fmt} is read by latentforge's own readers and generic libraries: use inspect")
    if importlib.util.find_spec(reader.module) is None:
        return ConsumerCheck(False, f"not checked: {reader.consumer}'s reader ({reader.module}) is not importable here "
                                    f"({reader.install})")  # fmt: skip
    if reader.check is None:
        return ConsumerCheck(False, f"not checked: {reader.consumer} is importable, but latentforge runs no reader of "
                                    f"it yet (format {fmt})")  # fmt: skip
    rows = [row for shard in ledger.read_all(out).values() for row in shard.values() if row.status == "done"]
    paths = sorted({record.path for row in rows for record in row.output_files()})
    return ConsumerCheck(True, f"{reader.consumer}: {reader.check(out, paths)}")
