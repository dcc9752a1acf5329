"""The GPU shot: the real product on one accelerator, every leg inside one budget, one summary line at the end.

Run by bench/gpu/run.sh on the GPU host (after the wheelhouse is installed), and by tests/test_gpu_shot.py here
with ``--device cpu`` at a tiny size. The legs, in the order they matter (a leg that would not fit in what is left
of ``--budget-s`` is skipped and says so; a leg that fails is recorded and the others run):

1. ``snapshot``: full-size Wan2.2 (the VAE's own config, a UMT5-XXL-sized text encoder; random weights made on the
   device, `bench.gpu_bench.make_snapshot`), and VBVR shards of the real clips (1080p among them);
2. ``decode``: one core's seconds to read and prepare one clip at the geometry (the decode bound's cost here);
3. ``vb1``: ``latentforge build --device cuda --dtype bf16 --video-batch 1`` at 33×832² on the embedded Prefect
   API (`bench.gpu_bench.measure`): s/sample over the steady state, busy (CUDA events), peak GPU memory, the share
   of the window each stage of the build's own spans covers (``held-by``: decode, write; text inside the
   encoder), then decode-and-verify of 2 samples on the device (its run report's PSNR/SSIM);
4. ``parity``: the same clips through seed 000's recipe as a plain loop (bench/gpu/plain.py, batch 1, same device
   and dtype): the build's ``x0`` and ``text_embeds`` equal to it bit for bit, or the distance in bf16 steps;
5. ``vb2``: the same build at ``--video-batch 2``;
6. ``ltx2``: LTX-2 with both VAEs at full size, a tiny Gemma (sized down to fit the time), audio, ``--format ltx``;
7. ``ltx2_8bit``: bench/gpu_ltx2_8bit.py (tiny LTX-2.5, ``--load-text-encoder-in-8bit``: loads, encodes, and
   its embeddings' largest distance from bf16);
8. ``cpu_fp32``: the recipe's plain loop in fp32 on the host's CPU cores for ``--cpu-samples`` samples (the CPU
   fp32 reference; a CPU *build* would encode each sample twice, its one-sample sanity included), and the GPU
   build's distance from it (max and mean |Δ| in bf16 steps); stopped at the budget.

Every leg's figures go to ``$OUT/shot.json`` (``--json``) as soon as the leg ends, and a line per leg is printed
as it ends, so a run stopped from outside still returns what it measured. Prints ``gpu-shot: ...`` last.
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
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu_bench  # noqa: E402
from bench.gpu.plain import DTYPES, PlainLoop, bf16_steps  # noqa: E402
from bench.throughput_bench import migrated_home  # noqa: E402
from infra.audit.run_report import latest_run_report  # noqa: E402
from infra.demo.testmedia import real_clip  # noqa: E402

logger = logging.getLogger("gpu_shot")
S_PER_SAMPLE_GOAL = 0.45
#: The least seconds each leg is given to start (judged against what is left of the budget).
NEEDS = {"vb1": 90, "parity": 45, "vb2": 60, "ltx2": 90, "ltx2_8bit": 60, "cpu_fp32": 60}


class Shot:
    """The legs' results, written to the JSON file after each leg; the budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.started, self.results = args, time.perf_counter(), {}
        self.json = Path(args.json) if args.json else None

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def leg(self, name: str, run: Callable[[], dict[str, Any]], need: float = 0.0) -> dict[str, Any] | None:
        """Run one leg unless less than `need` seconds are left; its result (or why not) recorded and printed."""
        if self.left() < need:
            self.results[name] = {"skipped": f"{self.left():.0f} s left of the budget, {need:.0f} needed"}
        else:
            began = time.perf_counter()
            try:
                self.results[name] = run() | {"leg_s": round(time.perf_counter() - began, 1)}
            except Exception as exc:  # noqa: BLE001 - a failed leg is a result; the other legs still run
                logger.error("%s failed:\n%s", name, traceback.format_exc())
                self.results[name] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        self.save()
        print(f"gpu-shot {name}: {json.dumps(self.results[name], default=str)[:600]}", flush=True)
        result = self.results[name]
        return None if "failed" in result or "skipped" in result else result

    def save(self) -> None:
        if self.json is not None:
            self.results["elapsed_s"] = round(time.perf_counter() - self.started, 1)
            self.json.write_text(json.dumps(self.results, indent=1, default=str))


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments `bench.gpu_bench`'s pieces take, from the shot's."""
    return gpu_bench.parse([
        "--size", args.size, "--device", args.device, "--dtype", args.dtype, "--samples", str(args.samples),
        "--shards", str(args.shards), "--frames", str(args.frames), "--height", str(args.height),
        "--width", str(args.width), "--decode-workers", str(args.decode_workers), "--clips", *args.clips,
        "--build-flags", args.build_flags,
    ])  # fmt: skip


def leg_figures(result: dict[str, Any]) -> dict[str, Any]:
    """A measured leg as the JSON keeps it (the stage shares and what holds it back included)."""
    held = gpu_bench.held_back_by(result)
    peak = result["peak"] / 2**30 if result["peak"] is not None else None
    return {k: v for k, v in result.items() if k != "peak"} | {"peak_gib": peak, "held_by": held}


def wan_leg(shot: Shot, ctx: dict[str, Any], name: str, flags: tuple[str, ...]) -> dict[str, Any]:
    leg = gpu_bench.Leg(name, ctx["model"], flags)
    result = leg_figures(gpu_bench.measure(leg, ctx["common"], ctx["work"], ctx["home"], timeout=shot.left()))
    report = latest_run_report(Path(result["out"]))
    if report is not None and report.decode is not None:
        decode = report.decode
        result["decode_verify"] = {"ok": decode.ok, "samples": len(decode.rows), "mean_psnr": decode.mean_psnr,
                                   "mean_ssim": decode.mean_ssim, "problems": decode.problems[:3]}  # fmt: skip
    return result


def stored(out: Path, generator: str, task: str, index: int) -> dict[str, torch.Tensor]:
    return torch.load(out / generator / f"{task}_{index:08d}.pt", weights_only=True)


def compare(build: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Equality and distance (bf16 steps) of a build sample's x0 and text_embeds from a reference's."""
    figures: dict[str, Any] = {}
    for key in ("x0", "text_embeds"):
        got, want = build[key], ref[key]
        figures[f"{key}_equal"] = bool(torch.equal(got, want))
        figures[f"{key}_steps_max"], figures[f"{key}_steps_mean"] = bf16_steps(got, want)
    return figures


def parity(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """The build's first samples (one per clip) against the plain loop on the build's device and dtype."""
    out, geometry = Path(ctx["vb1_out"]), (args.frames, args.height, args.width)
    loop = PlainLoop(ctx["model"], torch.device(args.device), DTYPES[args.dtype])
    rows = []
    for generator, task, index, clip, prompt in gpu_bench.sample_plan(args.samples, args.clips)[: len(args.clips)]:
        ref = {"x0": loop.x0(real_clip(clip).read_bytes(), *geometry), "text_embeds": loop.text_embeds(prompt)}
        rows.append({"clip": clip, **compare(stored(out, generator, task, index), ref)})
    del loop
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    every = all(row["x0_equal"] and row["text_embeds_equal"] for row in rows)
    return {"bit_equal": every, "samples": len(rows), "rows": rows}


def cpu_fp32(shot: Shot, args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """The plain loop in fp32 on the CPU for the first `--cpu-samples` samples, each its own process stopped at the
    budget; the GPU build's distance from it."""
    out, rows = Path(ctx["vb1_out"]), []
    for generator, task, index, clip, prompt in gpu_bench.sample_plan(args.samples, args.clips)[: args.cpu_samples]:
        target = ctx["work"] / f"cpu-fp32-{index}.pt"
        command = [sys.executable, str(ROOT / "bench/gpu/plain.py"), "--model", str(ctx["model"]), "--clip",
                   str(real_clip(clip)), "--prompt", prompt, "--geometry", str(args.frames), str(args.height),
                   str(args.width), "--device", "cpu", "--dtype", "fp32", "--out", str(target)]  # fmt: skip
        began = time.perf_counter()
        try:
            subprocess.run(command, check=True, timeout=max(shot.left() - 5, 1), capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            rows.append({"clip": clip, "stopped": f"at the budget after {time.perf_counter() - began:.0f} s"})
            break
        except subprocess.CalledProcessError as exc:
            rows.append({"clip": clip, "failed": exc.stderr[-500:]})
            break
        ref = torch.load(target, weights_only=True)
        figures = compare(stored(out, generator, task, index), ref)
        rows.append({"clip": clip, "seconds": round(time.perf_counter() - began, 1), **figures})
    return {"rows": rows}


def ltx2_leg(shot: Shot, args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    from infra.demo.tiny_ltx2 import make_tiny_ltx2  # noqa: PLC0415 - demo material, this leg only

    began = time.perf_counter()
    model = ctx["root"] / f"ltx2-{args.size}"
    if not (model / "model_index.json").exists():
        make_tiny_ltx2(model, seed=0, version="2.0", vae_size=args.size)
    made = time.perf_counter() - began
    flags = ("--family", "ltx2", "--format", "ltx", "--audio", "--video-batch", "1")
    leg = gpu_bench.Leg("ltx2", model, flags, files=".precomputed/latents/**/*.pt")
    result = gpu_bench.measure(leg, ctx["common"], ctx["work"], ctx["home"], timeout=shot.left())
    return leg_figures(result) | {"snapshot_s": round(made, 1)}


def ltx2_8bit(shot: Shot, args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "bench/gpu_ltx2_8bit.py"), "--device", args.device, "--ltx-version", "2.5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=max(shot.left(), 1))
    lines = [line for line in done.stdout.splitlines() if line.startswith("ltx2-8bit:")]
    if not lines:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-800:]}")
    return {"line": lines[-1], "exit": done.returncode}


def run(shot: Shot) -> None:
    args = shot.args
    bench = bench_args(args)
    root = Path(args.work)
    work = Path(tempfile.mkdtemp(prefix="shot-", dir=root))
    ctx: dict[str, Any] = {"root": root, "work": work}

    def setup() -> dict[str, Any]:
        began = time.perf_counter()
        ctx["model"], built = gpu_bench.make_snapshot(bench, root)
        snapshot = time.perf_counter() - began
        ctx["src"] = gpu_bench.make_source(work, args.samples, args.shards, args.clips)
        ctx["home"] = migrated_home(work / "prefect-home")
        ctx["common"] = gpu_bench.common_flags(bench, ctx["src"])
        clips = {name: round(real_clip(name).stat().st_size / 2**20, 2) for name in args.clips}
        return {"snapshot_s": round(snapshot, 1), "built": built, "clips_mib": clips,
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}  # fmt: skip

    if shot.leg("setup", setup) is None:
        return
    shot.leg("decode", lambda: {"core_s_per_clip": gpu_bench.decode_cost(work, ctx["src"], bench, len(args.clips))})
    torch.set_num_threads(os.cpu_count() or 1)  # decode_cost pinned one thread; the plain loops use them all
    first = shot.leg("vb1", lambda: wan_leg(shot, ctx, "vb1", ("--video-batch", "1", "--decode-samples", "2")),
                     NEEDS["vb1"])  # fmt: skip
    if first is not None:
        ctx["vb1_out"] = first["out"]
        shot.leg("parity", lambda: parity(args, ctx), NEEDS["parity"])
    shot.leg("vb2", lambda: wan_leg(shot, ctx, "vb2", ("--video-batch", "2")), NEEDS["vb2"])
    if not args.no_ltx2:
        shot.leg("ltx2", lambda: ltx2_leg(shot, args, ctx), NEEDS["ltx2"])
        shot.leg("ltx2_8bit", lambda: ltx2_8bit(shot, args, ctx), NEEDS["ltx2_8bit"])
    if first is not None and args.cpu_samples:
        shot.leg("cpu_fp32", lambda: cpu_fp32(shot, args, ctx), NEEDS["cpu_fp32"])


def wan_text(name: str, result: dict[str, Any]) -> str:
    if "s_per_sample" not in result:
        return f"{name}: {result.get('failed') or result.get('skipped')}"
    peak = f"{result['peak_gib']:.1f}GiB" if result.get("peak_gib") is not None else "n/a"
    goal = result["s_per_sample"] <= S_PER_SAMPLE_GOAL and result["busy"] >= gpu_bench.BUSY_TARGET
    text = (f"{name}: s/sample={result['s_per_sample']:.3f} busy={result['busy']:.1%} peak={peak} "
            f"goal={'met' if goal else 'missed'}")  # fmt: skip
    if result.get("held_by"):
        text += f" held-by={result['held_by']}"
    if "decode_verify" in result:
        verify = result["decode_verify"]
        text += f" decode-verify={'ok' if verify['ok'] else 'FAILED'}({verify['samples']})"
    return text


def summary(shot: Shot) -> str:
    r, args = shot.results, shot.args
    parts = [f"gpu-shot: device={args.device} dtype={args.dtype} size={args.size} "
             f"geometry={args.frames}x{args.height}x{args.width} samples={args.samples}"]  # fmt: skip
    for name in ("vb1", "vb2", "ltx2"):
        if name in r:
            parts.append(wan_text(name, r[name]))
    if "parity" in r:
        p = r["parity"]
        if "rows" in p:
            x0 = max(row["x0_steps_max"] for row in p["rows"])
            text = max(row["text_embeds_steps_max"] for row in p["rows"])
            equal = "bit-equal" if p["bit_equal"] else f"NOT equal (max steps x0 {x0:.0f}, text {text:.0f})"
            parts.append(f"parity(vb1 vs plain loop, {p['samples']}): {equal}")
        else:
            parts.append(f"parity: {p.get('failed') or p.get('skipped')}")
    if "cpu_fp32" in r:
        rows = [row for row in r["cpu_fp32"].get("rows", []) if "x0_steps_max" in row]
        if rows:
            x0 = ", ".join(f"{row['x0_steps_max']:.0f}/{row['x0_steps_mean']:.2f}" for row in rows)
            te = ", ".join(f"{row['text_embeds_steps_max']:.0f}/{row['text_embeds_steps_mean']:.2f}" for row in rows)
            parts.append(f"vs cpu-fp32 ({len(rows)}, max/mean bf16 steps): x0 {x0}; text {te}")
        else:
            parts.append(f"cpu-fp32: {json.dumps(r['cpu_fp32'])[:200]}")
    if "ltx2_8bit" in r:
        parts.append(r["ltx2_8bit"].get("line") or f"ltx2-8bit: {r['ltx2_8bit']}")
    parts.append(f"total={time.perf_counter() - shot.started:.0f}s budget={args.budget_s:.0f}s")
    return " | ".join(parts)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--samples", type=int, default=24, help="samples per Wan2.2 leg")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=832)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--clips", nargs="+", default=list(gpu_bench.CLIP_NAMES), choices=gpu_bench.CLIP_NAMES)
    parser.add_argument("--decode-workers", type=int, default=8)
    parser.add_argument("--build-flags", default="", help="more flags for every build")
    parser.add_argument("--cpu-samples", type=int, default=1, help="samples of the CPU fp32 reference (0: none)")
    parser.add_argument("--no-ltx2", action="store_true", help="leave out the two LTX-2 legs")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--work", default=None, help="where the snapshots are kept (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="the results file (default: $OUT/shot.json when OUT is set)")
    args = parser.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = str(Path(os.environ["OUT"]) / "shot.json")
    return args


def main(argv: list[str] | None = None) -> str:
    """Run the shot; print (and return) its summary line, whatever happened."""
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="gpu-shot-") as tmp:
        args.work = args.work or tmp
        Path(args.work).mkdir(parents=True, exist_ok=True)
        shot = Shot(args)
        try:
            run(shot)
        finally:
            line = summary(shot)
            shot.results["summary"] = line
            shot.save()
            print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
