"""The accelerator under the product: `latentforge build` itself, on real clips, with full-size models.

Set-up (timed, in the summary's ``setup=``): a local Wan2.2 snapshot at the real sizes (`infra.demo.tiny.make_wan22`
with ``size="full"``: the Wan2.2 VAE's own config and a UMT5-XXL text encoder, random weights from a fixed seed, made
on the device in the compute dtype and saved with ``save_pretrained``, reused when ``--model`` already holds one) and
real clips from the test-media cache (`infra.demo.testmedia`: 1920×1080, 1280×720, 640×272, 176×144) cycled into
``--shards`` VBVR shards, prompts repeating within two task families.

Before the legs, ``decode=``: the CPU seconds one core spends making one clip's pixels at the bench's geometry (the
pipeline's own read and `prepare`, one torch thread; `decode_cost`), the decode bound's cost on this host's CPUs.

Each leg is one fresh ``latentforge build --device cuda --dtype bf16`` at 33×832² (the CLI as a user runs it: the
embedded Prefect API, every gate, PyAV decode, writes, journal and ledger; decode-and-verify off, as in the other
throughput benches), ``--video-batch`` 1, 2 and 4. Per leg, over its steady state (from the first sample file
written to the last, as `bench/throughput_bench.py` measures it):

* s/sample: the window over the samples written after the first;
* busy: the union of the encoder spans inside the window over the window. The spans come from the build process
  itself (``LATENTFORGE_ENCODE_TIMING``, `infra.preprocess.timing`: CUDA events around each sample's encoder calls;
  on a CPU the calls' wall time); enc = s/sample × busy, the encoder's own seconds per sample (the encode bound);
* smi: the mean of ``nvidia-smi``'s utilization.gpu sampled every 200 ms in a background thread over the window;
* peak: ``torch.cuda.max_memory_allocated`` of the build process (from the same spans).

Budget: on one H200 the whole script must end within 8 minutes, set-up included (``--budget-s``): a leg that
would not fit in what is left (judged by the last leg's length) is skipped and the summary says so.

    bash bench/gpu.sh                # on a GPU host: full size, cuda, bf16, 33x832², video batches 1 2 4
    python bench/gpu_bench.py --size tiny --device cpu --dtype fp32 --frames 5 --height 32 --width 32 \\
        --samples 4 --shards 2 --video-batches 1 2       # its CPU path (tests/test_gpu_bench.py)

Extra legs (another family, e.g. LTX-2 in 8-bit) go in `EXTRA_LEGS` and are chosen with ``--extra-leg NAME``.

Prints one summary line: ``gpu-bench: device=... | vb1: s/sample=... busy=...% (hook: ..., N calls) ... | ...``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.feed_family import make_model  # noqa: E402
from bench.throughput_bench import migrated_home  # noqa: E402
from infra.config import BuildConfig  # noqa: E402
from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: E402
from infra.demo.testmedia import real_clip  # noqa: E402
from infra.devices import resolve_device, resolve_dtype  # noqa: E402
from infra.plan import make_plan  # noqa: E402
from infra.preprocess.prepare import prepare  # noqa: E402
from infra.preprocess.read import read  # noqa: E402
from infra.preprocess.timing import ENV as TIMING_ENV  # noqa: E402
from infra.preprocess.timing import read_timings  # noqa: E402
from infra.sources import open_source  # noqa: E402

logger = logging.getLogger("gpu_bench")

CLIP_NAMES = ("sample_1080p", "bigbuckbunny", "bikes", "carphone")
GENERATORS = ("G-11_handle_object_reappearance_data-generator", "O-21_ball_trajectory_data-generator")
PROMPTS_PER_GROUP = 2
VIDEO_BATCHES = (1, 2, 4)
BUSY_TARGET, BUDGET_S = 0.95, 480.0
#: The build's own timing spans (`infra.preprocess.timing`) a leg reports, and what each one is waiting on.
STAGES = ("encode", "text", "prepare", "write")
STAGE_NAMES = {"encode": "encode", "text": "text", "prepare": "decode", "write": "write"}
SMI_QUERY = ("nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits")
#: The GPU the builds run on (cuda:0): the first of CUDA_VISIBLE_DEVICES (an index or a UUID), else 0.
SMI_GPU = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"


@dataclass(frozen=True)
class Leg:
    """One measured `latentforge build`: its name in the summary, its model snapshot and its own flags."""

    name: str
    model: Path
    flags: tuple[str, ...] = ()
    files: str = "**/*.pt"  # the sample files under OUT whose mtimes make the steady state (one per sample)


#: Optional legs beyond the Wan2.2 video batches, by name (``--extra-leg NAME``): each makes its `Leg` (building
#: its own snapshot under the work folder) from the parsed arguments. An LTX-2 8-bit leg goes here.
EXTRA_LEGS: dict[str, Callable[[argparse.Namespace, Path], Leg]] = {}


@dataclass
class SmiSampler:
    """``nvidia-smi``'s utilization.gpu (%) and memory.used (MiB) of the builds' GPU, polled every `interval_s` by a
    background thread, each stamped with ``time.time`` (one call per sample: a looping ``nvidia-smi -lms`` writes
    into a pipe in buffered blocks, so its lines arrive late and its last ones are lost when it is stopped); nothing
    where there is no ``nvidia-smi``."""

    interval_s: float = 0.2
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _poller: threading.Thread | None = None

    def __enter__(self) -> SmiSampler:
        if shutil.which(SMI_QUERY[0]) is not None:
            self._poller = threading.Thread(target=self._poll, name="nvidia-smi", daemon=True)
            self._poller.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            began = time.time()
            try:
                done = subprocess.run([*SMI_QUERY, "--id", SMI_GPU], capture_output=True, text=True, timeout=10)
                util, used = (float(v) for v in done.stdout.splitlines()[0].split(",")[:2])
            except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
                pass  # a sample missed: the mean is over the samples taken
            else:
                self.samples.append(((began + time.time()) / 2, util, used))
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=15)

    def max_used_gib(self) -> float | None:
        return max(used for _, _, used in self.samples) / 1024 if self.samples else None

    def mean_util(self, start: float, end: float) -> float | None:
        inside = [util for at, util, _ in self.samples if start <= at <= end]
        return sum(inside) / len(inside) if inside else None


def make_snapshot(args: argparse.Namespace, root: Path) -> tuple[Path, bool]:
    """(the Wan2.2 snapshot, whether it was built now): ``--model`` (default: ROOT/model-SIZE) when it already holds
    one, else built there."""
    from infra.demo.tiny import make_wan22  # noqa: PLC0415 - heavy: diffusers and transformers, not when reused

    model = Path(args.model) if args.model else root / f"model-{args.size}"
    if (model / "model_index.json").exists():
        return model, False
    where = resolve_device(args.device)  # the weights are made where the builds will run (the CPU: the default)
    device = None if where.type == "cpu" else str(where)
    make_wan22(model, size=args.size, device=device, dtype=resolve_dtype(args.dtype), seed=0)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the builds need the device's memory, not this process
    return model, True


def sample_plan(samples: int, clip_names: Sequence[str]) -> list[tuple[str, str, int, str, str]]:
    """(generator, task, index, clip name, prompt) of each sample `make_source` writes: the clips cycled, a few
    prompts per task family."""
    plan = []
    for i in range(samples):
        group = i % len(GENERATORS)
        generator = GENERATORS[group]
        task = generator.split("_", 1)[1].removesuffix("_data-generator")
        prompt = f"task {group}: the object moves and comes back (template {i // 2 % PROMPTS_PER_GROUP})"
        plan.append((generator, task, i, clip_names[i % len(clip_names)], prompt))
    return plan


def make_source(root: Path, samples: int, shards: int, clip_names: Sequence[str]) -> Path:
    """`samples` VBVR samples of the real clips (`sample_plan`), in `shards` shards of consecutive samples (every
    shard a mix of the clips)."""
    data = {name: real_clip(name).read_bytes() for name in clip_names}
    src = root / "src"
    src.mkdir(parents=True)
    rows: list[list[DemoSample]] = [[] for _ in range(shards)]
    for generator, task, i, clip, prompt in sample_plan(samples, clip_names):
        files = {"ground_truth.mp4": data[clip], "prompt.txt": prompt.encode()}
        rows[i * shards // samples].append(DemoSample(generator=generator, task=task, index=i, files=files))
    for shard, shard_samples in enumerate(rows):
        write_vbvr_tar(src / f"gpu_part-{shard:05d}.tar", shard_samples)
    return src


def decode_cost(work: Path, src: Path, args: argparse.Namespace, clips: int) -> float:
    """CPU seconds one core spends making one clip's pixels at the bench's geometry (the pipeline's own read and
    `prepare`: decode, temporal sampling, resize), the mean over the source's first `clips` samples after one
    untimed warm-up, on one torch thread: the decode bound's cost per clip, measured on this host's CPUs. The plan
    is made with the bench-only stand-in family (`bench.feed_family`: the same span sampling and stretch resize as
    Wan2.2), so nothing of the snapshot is read."""
    torch.set_num_threads(1)  # this process runs no build: the legs are their own processes
    model = make_model(work / "decode-probe", 0.0, work / "decode-probe.busy")
    cfg = BuildConfig(source=f"vbvr:{src}", model=str(model), out=str(work / "decode-probe-out"),
                      family="bench.feed_family:FeedFamily", frames=args.frames, height=args.height,
                      width=args.width, device="cpu", dtype="fp32")  # fmt: skip
    plan, source = make_plan(cfg), open_source(cfg.source)
    raws = [read(ref) for shard in plan.shards for ref in source.samples(shard.shard)][:clips]
    prepare(raws[0], plan.job)  # the codecs' and the resize's first-call costs
    began = time.process_time()  # every thread of this process: PyAV's decoding threads too
    for raw in raws:
        prepare(raw, plan.job)
    return (time.process_time() - began) / len(raws)


def common_flags(args: argparse.Namespace, src: Path) -> list[str]:
    """The flags every leg shares: the source, the geometry, the device and dtype, the decode threads, and
    ``--build-flags``."""
    return [
        *("--source", f"vbvr:{src}", "--frames", str(args.frames), "--height", str(args.height)),
        *("--width", str(args.width), "--device", args.device, "--dtype", args.dtype),
        *("--decode-workers", str(args.decode_workers), "--decode-samples", "0"),
        *("--on-loss", "accept", "--on-conflict", "abort"),
        *shlex.split(args.build_flags),
    ]


def union_within(spans: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by at least one span (spans of two shard threads may overlap)."""
    covered, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def measure(leg: Leg, common: list[str], work: Path, home: Path, timeout: float) -> dict:
    """One leg: a fresh `latentforge build`, its steady-state s/sample, busy fraction, nvidia-smi mean, peak."""
    out, timing = work / f"out-{leg.name}", work / f"{leg.name}.timing"
    env = {**os.environ, "PREFECT_HOME": str(home), TIMING_ENV: str(timing)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a busy 2-core machine
    command = [sys.executable, "-m", "flows.cli", "build", *common, "--out", str(out), "--model", str(leg.model)]
    began = time.perf_counter()
    with SmiSampler() as smi:
        done = subprocess.run([*command, *leg.flags], env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{leg.name}: build exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    written = sorted(path.stat().st_mtime for path in out.glob(leg.files))
    every = read_timings(timing)
    spans = [span for span in every if span.get("stage", "encode") == "encode"]
    if len(written) < 2 or not spans:
        raise RuntimeError(f"{leg.name}: {len(written)} sample file(s), {len(spans)} timed call(s): no steady state")
    start, end = written[0], written[-1]
    window = end - start
    peaks = [span["peak_bytes"] for span in spans if span["peak_bytes"] is not None]
    busy = union_within([(s["start"], s["end"]) for s in spans], start, end) / window if window > 0 else 0.0
    return {
        "leg": leg.name,
        "samples": len(written),
        "s_per_sample": window / (len(written) - 1),
        "busy": busy,
        "clock": spans[-1]["clock"],
        "calls": len(spans),
        "stages": stage_shares(every, start, end),
        "smi": smi.mean_util(start, end),
        "smi_used": smi.max_used_gib(),
        "peak": max(peaks) if peaks else None,
        "seconds": seconds,
        "out": str(out),
    }


def stage_shares(spans: Sequence[dict], start: float, end: float) -> dict[str, float]:
    """Per stage of the build's own spans (`STAGES`), the share of the window [start, end] it covers."""
    window = end - start
    shares = {}
    for stage in STAGES:
        mine = [(s["start"], s["end"]) for s in spans if s.get("stage", "encode") == stage]
        shares[stage] = union_within(mine, start, end) / window if window > 0 else 0.0
    return shares


def held_back_by(result: dict) -> str | None:
    """Under the busy target: the stage outside the encoder whose spans cover most of the window (the shard loop
    waiting for pixels is ``decode``), with its share; None at or over the target."""
    if result["busy"] >= BUSY_TARGET:
        return None
    outside = {STAGE_NAMES[stage]: result["stages"][stage] for stage in ("prepare", "write")}
    name, share = max(outside.items(), key=lambda item: item[1])
    text = result["stages"]["text"]
    return f"{name} ({share:.0%} of the window; text {text:.0%} inside the encoder)"


def legs(args: argparse.Namespace, model: Path, work: Path) -> list[Leg]:
    """The Wan2.2 legs (one per ``--video-batches`` value), then the chosen extra legs."""
    wan = [Leg(f"vb{n}", model, ("--video-batch", str(n))) for n in args.video_batches]
    return wan + [EXTRA_LEGS[name](args, work) for name in args.extra_leg]


def run(args: argparse.Namespace, root: Path, work: Path) -> tuple[list[dict | str], float, float]:
    """(each leg's figures, or why it was not run; the set-up's seconds; the decode cost, `decode_cost`): the
    snapshot under `root` (kept), the clips, the Prefect home and the legs' caches under `work` (this run's own)."""
    started = time.perf_counter()
    model, built = make_snapshot(args, root)
    src = make_source(work, args.samples, args.shards, args.clips)
    home = migrated_home(work / "prefect-home")  # untimed in a user's run: a Prefect home is migrated once
    setup = time.perf_counter() - started
    logger.info("set-up %.1f s (snapshot %s)", setup, "built" if built else f"reused from {model}")
    decode = decode_cost(work, src, args, clips=len(args.clips))
    common, results, last = common_flags(args, src), [], 0.0
    for leg in legs(args, model, work):
        left = args.budget_s - (time.perf_counter() - started)
        if left < last:
            results.append(f"{leg.name}: skipped ({left:.0f} s left of the budget, the last leg took {last:.0f} s)")
            continue
        try:
            results.append(measure(leg, common, work, home, timeout=left))
        except subprocess.TimeoutExpired:
            results.append(f"{leg.name}: stopped at the budget ({args.budget_s:.0f} s)")
            continue
        except RuntimeError as exc:  # the other legs still run; the summary names this one's failure
            logger.error("%s", exc)
            results.append(f"{leg.name}: failed ({str(exc).splitlines()[0]})")
            continue
        last = results[-1]["seconds"]
        logger.info("%s", results[-1])
    return results, setup, decode


def leg_text(result: dict | str) -> str:
    if isinstance(result, str):
        return result
    smi = f"{result['smi']:.0f}%,{result['smi_used']:.1f}GiB" if result["smi"] is not None else "n/a"
    peak = f"{result['peak'] / 2**30:.1f}GiB" if result["peak"] is not None else "n/a"
    held = held_back_by(result)
    return (
        f"{result['leg']}: s/sample={result['s_per_sample']:.3f} busy={result['busy']:.1%} "
        f"(hook: {result['clock']}, {result['calls']} calls) enc={result['s_per_sample'] * result['busy']:.3f}s "
        f"smi={smi} peak={peak} run={result['seconds']:.0f}s" + (f" held-by={held}" if held else "")
    )


def summary(args: argparse.Namespace, results: list[dict | str], setup: float, decode: float, total: float) -> str:
    head = (
        f"gpu-bench: device={args.device} size={args.size} geometry={args.frames}x{args.height}x{args.width} "
        f"samples={args.samples} shards={args.shards} decode-workers={args.decode_workers} "
        f"decode={decode:.3f}core-s/clip"
    )
    tail = (
        f"setup={setup:.0f}s total={total:.0f}s (targets: busy >= {BUSY_TARGET:.0%}, "
        f"total <= {BUDGET_S:.0f} s on one H200)"
    )
    return " | ".join([head, *(leg_text(result) for result in results), tail])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--samples", type=int, default=16, help="samples per leg (the steady state: samples - 1)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--clips", nargs="+", default=list(CLIP_NAMES), choices=CLIP_NAMES)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=832)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--video-batches", type=int, nargs="+", default=list(VIDEO_BATCHES))
    parser.add_argument("--decode-workers", type=int, default=8)
    parser.add_argument("--build-flags", default="", help='more flags for every leg\'s build, e.g. "--workers 1"')
    parser.add_argument("--extra-leg", action="append", default=[], choices=sorted(EXTRA_LEGS))
    parser.add_argument("--model", help="the snapshot folder: reused when it holds one, else built there")
    parser.add_argument("--work", help="where the snapshot is kept between runs (default: a temporary folder)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    """Run the bench and print (and return) its one summary line."""
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        root = Path(args.work) if args.work else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
        try:
            results, setup, decode = run(args, root, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    line = summary(args, results, setup, decode, time.perf_counter() - started)
    print(line)  # the bench's one summary line
    return line


if __name__ == "__main__":
    main()
