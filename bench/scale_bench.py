"""Cost that grows linearly with the work: plan, build, resume, verify-existing and reconcile at 10^3, 10^4 (and
10^5) samples of tiny clips, each step in a fresh process, timed, with its peak RSS.

The clips are tiny on purpose (2 frames of 32×32, a few hundred bytes each) so that the per-sample overheads show:
listing, ledger rows, journal, writes, checks. The encoder is the bench-only stand-in family
(`bench.feed_family`, latency 0): the build measures everything around the encoder. Steps:

* plan: `make_plan` (tar headers listed, samples counted, output names checked);
* build: `latentforge build` as a user runs it (a fresh process, the embedded Prefect API, every gate);
* resume: the same command again on the finished cache (nothing to encode); the media reads of its shard tasks
  and of its one-sample sanity are counted (goal: none in the shards);
* verify: `verify_plan` of the finished cache, the stale pass over the source included (the plan made untimed);
* reconcile: `reconcile` of the finished cache (the plan made untimed).

``--listing N`` adds a listing-only size (default 10^5): shards of tiny members that are never built; there
plan, verify and reconcile run over a cache synthesised from the built one's pattern (its ledger rows repeated
under new keys, its sample file hard-linked), so they see 10^5 done rows and files. Printed: a table per step with
the growth factor per 10× (goal ≤ 11×), and the sum plan + verify + reconcile at the largest size (goal < 60 s).

    python bench/scale_bench.py                 # 10^3 and 10^4 built, 10^5 listing-only
    python bench/scale_bench.py --sizes 1000 --listing 10000    # quick
    python bench/scale_bench.py --sizes 100000 --listing --steps build --timeline   # the build's RSS as it goes
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.feed_family import make_model  # noqa: E402

FAMILY = "bench.feed_family:FeedFamily"
FRAMES, SIZE = 2, 32
PER_SHARD = 1000
#: Hard links per copy of the synthesised cache's sample file (ext4 allows 65,000 links to one file).
LINKS_PER_FILE = 50_000
GENERATOR, TASK = "G-11_handle_object_reappearance_data-generator", "handle_object_reappearance"
GROWTH_GOAL, SUM_GOAL_S = 11.0, 60.0
BUILT_STEPS = ("plan", "build", "resume", "verify", "reconcile")
LISTING_STEPS = ("plan", "verify", "reconcile")

logger = logging.getLogger("scale_bench")


def tiny_clip() -> bytes:
    """2 frames of 32×32 (H.264 in MP4): a real clip, as small as one gets."""
    import av  # noqa: PLC0415 - heavy: only where the workload is made
    import numpy as np  # noqa: PLC0415 - with av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
        for i in range(FRAMES):
            image = np.full((SIZE, SIZE, 3), 40 * (i + 1), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def write_source(src: Path, samples: int, clip: bytes) -> Path:
    """VBVR shards of `PER_SHARD` samples each: the tiny clip and a prompt per sample (written once per size)."""
    src.mkdir(parents=True, exist_ok=True)
    prompt = b"a tiny clip"
    for first in range(0, samples, PER_SHARD):
        with tarfile.open(src / f"scale_part-{first // PER_SHARD:05d}.tar", "w") as tf:
            for index in range(first, min(first + PER_SHARD, samples)):
                directory = f"{GENERATOR}/{TASK}_task/{TASK}_{index:08d}"
                for name, data in (("ground_truth.mp4", clip), ("prompt.txt", prompt)):
                    info = tarfile.TarInfo(f"{directory}/{name}")
                    info.size, info.mtime = len(data), 1_704_067_200
                    tf.addfile(info, io.BytesIO(data))
    return src


def config_values(root: Path, samples: int) -> dict:
    return {
        "source": f"vbvr:{root / f'src-{samples}'}",
        "model": str(root / "model"),
        "out": str(root / f"out-{samples}"),
        "family": FAMILY,
        "frames": FRAMES,
        "height": SIZE,
        "width": SIZE,
        "device": "cpu",
        "dtype": "fp32",
    }


def cli_flags(root: Path, samples: int) -> list[str]:
    values = config_values(root, samples)
    flags = ["build"]
    for name in ("source", "model", "out", "family", "frames", "height", "width", "device", "dtype"):
        flags += [f"--{name}", str(values[name])]
    return [*flags, "--decode-samples", "0", "--on-loss", "accept", "--on-conflict", "abort", "--on-stale", "abort"]


# ----------------------------------------------------------------------------- the children


def child(step: str, root: Path, samples: int, report: Path) -> None:
    """One step in this (fresh) process; what it measured into `report` (its peak RSS is the parent's to read)."""
    if step in ("build", "resume"):
        return cli_child(root, samples, report)
    from infra.config import BuildConfig  # noqa: PLC0415 - heavy: after the child is told what to run
    from infra.plan import make_plan  # noqa: PLC0415 - heavy

    config = BuildConfig(**config_values(root, samples))
    start = time.perf_counter()
    plan = make_plan(config)
    seconds, facts = time.perf_counter() - start, {"shards": len(plan.shards)}
    if step == "verify":
        from infra.gates.verify import verify_plan  # noqa: PLC0415 - heavy

        start = time.perf_counter()
        verified = verify_plan(plan.job, plan.shards)
        seconds = time.perf_counter() - start
        facts = {"kind": verified.kind, "done": verified.done, "stale": len(verified.stale or [])}
    elif step == "reconcile":
        from infra.audit.reconcile import reconcile  # noqa: PLC0415 - heavy

        start = time.perf_counter()
        reconciled = reconcile(plan.job, plan.shards, plan.source_shards)
        seconds = time.perf_counter() - start
        facts = {"headline": reconciled.headline()}
    report.write_text(json.dumps({"seconds": seconds, **facts}))


def cli_child(root: Path, samples: int, report: Path) -> None:
    """`latentforge build` in this process as its console entry point runs it (`flows.cli.main` ends the process;
    the report is written by an exit handler), with the media reads of the shard tasks and of the sanity counted."""
    import atexit  # noqa: PLC0415 - the child only

    from flows import cli  # noqa: PLC0415 - heavy: the child only
    from infra.preprocess import encode, shard  # noqa: PLC0415 - heavy: the child only

    reads = {"shard": 0, "sanity": 0}

    def counted(where: str, read: Callable[..., Any]) -> Callable[..., Any]:
        """`read`, counting its calls: a counter around the stage's own function, nothing replaced."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            reads[where] += 1
            return read(*args, **kwargs)

        return wrapper

    shard.read = counted("shard", shard.read)  # the shard loop and its read-ahead look `read` up when they run
    encode.read = counted("sanity", encode.read)  # encode_sample: the one-sample sanity
    start = time.perf_counter()
    atexit.register(lambda: report.write_text(json.dumps({"seconds": time.perf_counter() - start, "reads": reads})))
    sys.argv = ["latentforge", *cli_flags(root, samples)]
    cli.main()


# ----------------------------------------------------------------------------- the parent


def run_step(step: str, root: Path, samples: int, home: Path, profile: bool = False, timeline: bool = False) -> dict:
    """One step in a fresh process: what it reports, its wall seconds and peak RSS (MiB); `profile`: its main
    thread under cProfile, the stats in ROOT/STEP-SAMPLES.prof; `timeline`: the build's RSS as it goes
    (`RssTimeline`), under "rss" in the result."""
    report = root / f"{step}-{samples}.json"
    env = {**os.environ, "PREFECT_HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT),
           os.environ.get("PYTHONPATH"))))}  # fmt: skip
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    command = [sys.executable, __file__, "--child", step, str(root), str(samples), str(report)]
    if profile:
        command[1:1] = ["-m", "cProfile", "-o", str(root / f"{step}-{samples}.prof")]
    start = time.perf_counter()
    with (root / f"{step}-{samples}.log").open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = RssTimeline(proc.pid, root / f"out-{samples}") if timeline and step == "build" else None
        _, status, usage = os.wait4(proc.pid, 0)
        if sampler is not None:
            sampler.stop()
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not report.exists():
        tail = (root / f"{step}-{samples}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{step} at {samples} exited {code}:\n{tail}")
    result = json.loads(report.read_text())
    result.update(wall=wall, peak_mib=usage.ru_maxrss / 1024)
    if sampler is not None:
        result["rss"] = sampler.summary(samples)
    logger.info("%s %d: %s", step, samples, result)
    return result


class RssTimeline:
    """The RSS of a running build beside the sample files it has written, sampled every `every` seconds on a thread
    of this (the parent) process: whether the build grows as it goes, which a peak cannot say. Counting the files
    lists OUT each time (~0.3 s of a core at 10^5), so a `--timeline` run's seconds are not the table's."""

    def __init__(self, pid: int, out: Path, every: float = 2.0) -> None:
        self.points: list[tuple[int, float]] = []  # (sample files written, RSS MiB)
        self._process, self._out, self._every = psutil.Process(pid), out, every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-timeline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            try:
                rss = self._process.memory_info().rss / 2**20
            except psutil.Error:
                return
            files = sum(1 for _ in self._out.rglob("*.pt")) if self._out.exists() else 0
            self.points.append((files, rss))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def summary(self, samples: int) -> dict:
        """The RSS at the first sample written, at half and at the last sample before all were written (what follows
        is the run's end: reconcile, report), and the growth per sample from half to there (bytes): flat is what a
        run of 10^6 samples needs."""
        written = [(files, rss) for files, rss in self.points if 0 < files < samples]
        if len(written) < 2:
            return {}
        first, last = written[0], written[-1]
        half = next(point for point in written if point[0] >= samples // 2 or point is last)
        per_sample = (last[1] - half[1]) * 2**20 / max(last[0] - half[0], 1)
        return {"first": first, "half": half, "last": last, "bytes_per_sample_second_half": round(per_sample, 1)}


def synthesise(root: Path, built: int, samples: int) -> None:
    """A finished cache of `samples` from the built one of `built`: its ledger rows repeated under the listing's
    keys (one shard's ledger per listing shard), its first sample's file hard-linked at each new path, its
    cache.json copied (the same spec: the listing's shards are of the same layout)."""
    from infra.cache import ledger  # noqa: PLC0415 - heavy: the parent, listing-only sizes

    src_out, out = root / f"out-{built}", root / f"out-{samples}"
    rows = ledger.read_shard(src_out, "scale_part-00000")
    template = next(iter(rows.values()))
    first = src_out / template.path
    out.mkdir(parents=True)
    (out / "cache.json").write_bytes((src_out / "cache.json").read_bytes())
    data = template.model_dump(mode="json")
    for first_index in range(0, samples, PER_SHARD):
        shard_id = f"scale_part-{first_index // PER_SHARD:05d}"
        new_rows = []
        for index in range(first_index, min(first_index + PER_SHARD, samples)):
            sid = f"{TASK}_{index:08d}"
            text = json.dumps(data).replace(template.id, sid).replace(template.shard, shard_id)
            row = ledger.LedgerRow.model_validate_json(text)
            target = out / row.path
            target.parent.mkdir(parents=True, exist_ok=True)
            if index % LINKS_PER_FILE == 0 and index:  # a file system's limit on hard links to one file
                first = shutil.copy2(first, out / f"link-base-{index}.pt")
            os.link(first, target)
            new_rows.append(row)
        ledger.seal(out, shard_id, new_rows)


def per_ten(sizes: list[int], values: list[float]) -> list[float]:
    """The growth factor of `values` per 10× samples between successive sizes."""
    return [
        (b / a) ** (1 / math.log10(m / n)) for (n, a), (m, b) in itertools.pairwise(zip(sizes, values, strict=True))
    ]


def table(results: dict[str, dict[int, dict]]) -> str:
    lines = [f"{'step':<10} {'samples':>8} {'seconds':>8} {'per 10×':>8} {'peak MiB':>9} {'per 10×':>8}  note"]
    for step, by_size in results.items():
        sizes = sorted(by_size)
        seconds = [by_size[n]["seconds"] for n in sizes]
        peaks = [by_size[n]["peak_mib"] for n in sizes]
        time_growth, peak_growth = [None, *per_ten(sizes, seconds)], [None, *per_ten(sizes, peaks)]
        for n, s, gs, p, gp in zip(sizes, seconds, time_growth, peaks, peak_growth, strict=True):
            note = {k: v for k, v in by_size[n].items() if k not in ("seconds", "peak_mib", "wall", "rss")}
            shown = [f"{g:.1f}×" if g is not None else "" for g in (gs, gp)]
            lines.append(f"{step:<10} {n:>8} {s:>8.2f} {shown[0]:>8} {p:>9.0f} {shown[1]:>8}  {json.dumps(note)[:90]}")
        worst = max(time_growth[1:], default=0.0)
        if len(sizes) > 1:
            verdict = "PASS" if worst <= GROWTH_GOAL else "MISS"
            lines.append(f"{'':<10} worst time growth {worst:.1f}× per 10× (goal ≤ {GROWTH_GOAL:g}×): {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000], help="sizes built")
    parser.add_argument("--listing", type=int, nargs="*", default=[100000], help="listing-only sizes")
    parser.add_argument("--steps", nargs="+", default=list(BUILT_STEPS))
    parser.add_argument("--profile", action="store_true", help="each step's main thread under cProfile (--keep)")
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temp dir, removed)")
    parser.add_argument("--timeline", action="store_true", help="the build's RSS every 2 s beside the files written")
    parser.add_argument("--child", nargs=4, metavar=("STEP", "ROOT", "SAMPLES", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.child:
        step, root, samples, report = args.child
        return child(step, Path(root), int(samples), Path(report))
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        make_model(root / "model", 0.0, root / "busy.log")
        home = root / "prefect-home"
        home.mkdir(exist_ok=True)
        prefect = str(Path(sys.executable).with_name("prefect"))
        upgrade = [prefect, "server", "database", "upgrade", "-y"]
        subprocess.run(upgrade, env={**os.environ, "PREFECT_HOME": str(home)}, check=True, capture_output=True)
        clip = tiny_clip()
        results: dict[str, dict[int, dict]] = {step: {} for step in args.steps}
        for samples in args.sizes:
            write_source(root / f"src-{samples}", samples, clip)
            for step in args.steps:
                results[step][samples] = run_step(step, root, samples, home, args.profile, args.timeline)
        for samples in args.listing:
            write_source(root / f"src-{samples}", samples, clip)
            synthesise(root, args.sizes[0], samples)
            for step in (s for s in args.steps if s in LISTING_STEPS):
                results[step][samples] = run_step(step, root, samples, home, args.profile)
    largest = max([*args.sizes, *args.listing])
    summed = [s for s in LISTING_STEPS if largest in results.get(s, {})]
    logger.info("\nscale: tiny clips (%d frames of %d², %d samples a shard), stand-in encoder", FRAMES, SIZE, PER_SHARD)
    logger.info("%s", table(results))
    for samples, built in sorted(results.get("build", {}).items()):
        rss = built.get("rss")
        if rss:
            points = ", ".join(f"{rss[k][1]:.1f} MiB at {rss[k][0]:,}" for k in ("first", "half", "last"))
            logger.info("build %d, RSS as it went: %s samples written; over the second half %.1f bytes a sample",
                        samples, points, rss["bytes_per_sample_second_half"])  # fmt: skip
    if summed == list(LISTING_STEPS):
        total = sum(results[s][largest]["seconds"] for s in summed)
        verdict = "PASS" if total < SUM_GOAL_S else "MISS"
        logger.info("plan + verify + reconcile at %d: %.1f s (goal < %g s): %s", largest, total, SUM_GOAL_S, verdict)


if __name__ == "__main__":
    main()
