"""``--load-text-encoder-in-8bit`` on a GPU, nothing downloaded: a tiny-but-real LTX-2 snapshot (the real diffusers
and transformers classes, Gemma 4 for ``--ltx-version 2.5``), two synthetic clips, then

1. the family loaded as a build loads it (8-bit options): how many of Gemma's Linear layers bitsandbytes made
   8-bit, and the largest difference of one prompt's conditions from the same prompt encoded in the compute dtype;
2. ``latentforge build --device cuda --load-text-encoder-in-8bit`` over the clips (its own process, as a user runs
   it), and the spec it recorded.

    python bench/gpu_ltx2_8bit.py --device cuda --ltx-version 2.5    # on the GPU host (bench/gpu.sh runs it)
    python bench/gpu_ltx2_8bit.py --device cpu                        # its CPU path: the build is refused, exit 2

Prints one line: ``ltx2-8bit: version=... device=... int8_layers=N max_abs_diff=... build=ok samples=2 ...`` or,
off CUDA or without bitsandbytes, ``ltx2-8bit: refused exit=2 ...`` with the CLI's message.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.demo.tiny_ltx2 import make_tiny_ltx2
from infra.models import load_family
from infra.models.base import TextSettings
from infra.models.memory import LoadOptions

logger = logging.getLogger("gpu_ltx2_8bit")
ROOT = Path(__file__).resolve().parents[1]
BUCKET = "64x64x9"
CAPTIONS = ("a red square drifts to the right", "  stripes scroll down the frame  ")


def write_clip(path: Path, seed: int, frames: int = 17, size: int = 96) -> None:
    """A small H.264 clip of moving noise-and-gradient frames (deterministic in `seed`)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(24))
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = np.roll(base, 3 * i, axis=1 - seed % 2)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def write_dataset(root: Path) -> Path:
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, caption in enumerate(CAPTIONS):
        write_clip(root / "clips" / f"clip{i}.mp4", seed=i)
        rows.append({"video": f"clips/clip{i}.mp4", "caption": caption})
    path = root / "dataset.json"
    path.write_text(json.dumps(rows))
    return path


def text_check(model: Path, device: torch.device) -> tuple[int, float]:
    """(8-bit Linear layers in Gemma, max |conditions in 8-bit − conditions in bf16|) for the first caption."""
    import bitsandbytes as bnb  # noqa: PLC0415 - the GPU host's optional dependency, only on this path

    settings = TextSettings(1024, "raw", "pre_connector")
    full = load_family(model, "ltx2", device, torch.bfloat16).encode_text(CAPTIONS[0], settings)
    eight_bit = load_family(model, "ltx2", device, torch.bfloat16, LoadOptions(text_8bit=True))
    layers = sum(isinstance(m, bnb.nn.Linear8bitLt) for m in eight_bit.text_encoder.modules())
    quantized = eight_bit.encode_text(CAPTIONS[0], settings)
    return layers, float((quantized.embeds.float() - full.embeds.float()).abs().max())


def build(dataset: Path, model: Path, out: Path, device: str) -> subprocess.CompletedProcess[str]:
    args = ["build", "--source", f"meta:{dataset}", "--model", str(model), "--out", str(out), "--format", "ltx"]
    args += ["--buckets", BUCKET, "--device", device, "--load-text-encoder-in-8bit", "--no-audio"]
    args += ["--on-conflict", "abort", "--on-loss", "abort", "--decode-samples", "0"]
    # this tree first, then what the caller's PYTHONPATH holds (bitsandbytes may be installed there, not in the venv)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PREFECT_HOME": str(out.parent / "prefect")}
    command = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ltx-version", default="2.5", choices=("2.0", "2.3", "2.5"))
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ltx2-8bit-") as tmp:
        work = args.work or Path(tmp)
        model = make_tiny_ltx2(work / "model", seed=0, version=args.ltx_version)
        dataset = write_dataset(work / "data")
        head = f"ltx2-8bit: version={args.ltx_version} device={args.device}"
        start = time.perf_counter()
        result = build(dataset, model, work / "out", args.device)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            message = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
            line = f"{head} refused exit={result.returncode} {message}"
        else:
            spec = json.loads((work / "out" / "cache.json").read_text())["spec"]
            samples = len(list((work / "out" / ".precomputed" / "conditions").rglob("*.pt")))
            layers, diff = text_check(model, torch.device(args.device))
            line = (
                f"{head} int8_layers={layers} max_abs_diff={diff:.4f} build=ok samples={samples} s={seconds:.1f} "
                f"spec_8bit={spec['load_text_encoder_in_8bit']} spec_version={spec.get('model_version')}"
            )
    sys.stdout.write(line + "\n")
    return line


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
