"""A bench-only family: a stand-in encoder that takes a fixed time per clip and releases the GIL while it waits
(``time.sleep``), as a call into an accelerator does, and records when it was busy.

With it, `latentforge build` runs its real pipeline (the source's tar reads, PyAV decode, temporal sampling and
resize, writes, journal and ledger) around an encoder whose demand is known, so how much of the time the encoder
is kept busy is measured without an accelerator (`bench/feed_bench.py`). Its latents are the pixels average-pooled
8×8 in space: they depend on what was decoded, and decode back (nearest upsampling) for decode-and-verify.

Used as ``--family bench.feed_family:FeedFamily``; its model directory (`make_model`) holds only
``vae/config.json``: the latency per clip and the file the busy intervals are appended to (one ``START END`` line
per encoder call, ``time.monotonic`` seconds: the same clock in every process of the machine).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.models.base import FamilySpec, GeometryRules, LoadedFamily, TextEmbedding, TextSettings

#: The spatial pooling of the stand-in latents.
DOWN = 8


def make_model(directory: Path, latency_s: float, log: Path) -> Path:
    """A model directory for the stand-in: its latency per clip and where it logs its busy intervals."""
    vae = Path(directory) / "vae"
    vae.mkdir(parents=True, exist_ok=True)
    (vae / "config.json").write_text(json.dumps({"latency_s": latency_s, "log": str(log)}))
    return Path(directory)


def read_intervals(log: Path) -> list[tuple[float, float]]:
    """The (start, end) of every encoder call the log holds, in the order they ended."""
    if not log.exists():
        return []
    return [(float(a), float(b)) for a, b in (line.split() for line in log.read_text().splitlines() if line)]


def busy_fraction(intervals: Sequence[tuple[float, float]]) -> float:
    """The encoder's busy fraction over the steady state: from the end of its first call to the end of its last,
    the time spent in calls (the first call, which waited for start-up and the first decode, is left out).
    NaN with fewer than two calls."""
    if len(intervals) < 2:
        return float("nan")
    ordered = sorted(intervals)
    window = ordered[-1][1] - ordered[0][1]
    busy = sum(end - start for start, end in ordered[1:])
    return busy / window if window > 0 else float("nan")


class FeedEncoder(LoadedFamily):
    """Sleeps `latency_s` per clip (the GIL released), then pools the pixels; appends each call's interval."""

    name = "feed"

    def __init__(self, model_dir: Path) -> None:
        settings: dict[str, Any] = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
        self.latency, self.log = float(settings["latency_s"]), Path(settings["log"])

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        start = time.monotonic()
        time.sleep(self.latency)
        latents = torch.nn.functional.avg_pool3d(pixels.float(), (1, DOWN, DOWN))[0]
        end = time.monotonic()
        with self.log.open("a") as log:  # one short line per call: appends from threads do not interleave
            log.write(f"{start:.6f} {end:.6f}\n")
        return latents

    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        raise NotImplementedError("the feed family stores no text embeddings")

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        up = torch.nn.functional.interpolate(latents.float()[None], scale_factor=(1, DOWN, DOWN), mode="nearest")
        return up[0].clamp(-1, 1)


class FeedFamily(FamilySpec):
    """The stand-in family: video clips in, pooled pixels out, latents only."""

    name = "feed"
    components = ("vae",)
    latent_norm = "none: average-pooled pixels (a bench stand-in)"
    output_kinds = ("latents",)
    defaults: ClassVar[dict[str, Any]] = {
        "temporal": "linspace",
        "resize": "stretch",
        "text_max_length": 1,
        "text_stage": "last_hidden_state",
    }

    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        return False

    def rules(self, model_dir: Path) -> GeometryRules:
        return GeometryRules(frame_multiple=1, frame_remainder=0, spatial_multiple=DOWN)

    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        return (3, frames, height // DOWN, width // DOWN)

    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        return ()

    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedFamily:
        return FeedEncoder(model_dir)
