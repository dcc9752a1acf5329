"""What a suspect costs (`infra.preprocess.alone`): a sample's decode and prepare in a child process of its own,
against the same in this process, in seconds a sample (wall; the child's start is most of it) and the child's CPU
seconds (its own, so less moved by a busy machine), at the recipe's 33 frames. The child's pixels are checked equal
to this process's.

The command line is imported first, as in a build: a spawned child runs its parent's main module again (a build's:
`flows.cli`), so its start here costs what it costs a real build's suspect.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flows.cli  # noqa: E402, F401 - a build's main module: its children import it again
from bench.feed_bench import CLIP_NAMES, make_source  # noqa: E402
from bench.feed_family import make_model  # noqa: E402
from infra.config import BuildConfig  # noqa: E402
from infra.plan import make_plan  # noqa: E402
from infra.preprocess.alone import prepare_alone  # noqa: E402
from infra.preprocess.prepare import prepare  # noqa: E402
from infra.preprocess.read import read  # noqa: E402
from infra.sources import open_source  # noqa: E402

logger = logging.getLogger("suspect_bench")
FAMILY = "bench.feed_family:FeedFamily"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clips", type=int, default=len(CLIP_NAMES))
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = make_source(root, args.clips)
        model = make_model(root / "model", 0.0, root / "busy.log")
        size = {"frames": args.frames, "height": args.size, "width": args.size}
        cfg = BuildConfig(source=f"vbvr:{src}", model=str(model), out=str(root / "out"), family=FAMILY, device="cpu",
                          dtype="fp32", **size)  # fmt: skip
        plan = make_plan(cfg)
        source = open_source(cfg.source, plan.job.spec, plan.job.limits)
        rows = []
        for ref in source.samples(plan.shards[0].shard):
            raw = read(ref)
            start, here_cpu = time.perf_counter(), time.process_time()
            here = prepare(raw, plan.job)
            middle, here_cpu = time.perf_counter(), time.process_time() - here_cpu
            before = _children_cpu()
            alone = prepare_alone(raw, plan.job)
            end, cpu = time.perf_counter(), _children_cpu() - before
            same = alone.video.pixels.equal(here.video.pixels)
            rows.append((ref.key.rsplit("/", 1)[-1], middle - start, end - middle, here_cpu, cpu, same))
    print(f"{'sample':<40} {'here s':>7} {'alone s':>8} {'extra s':>8} {'here cpu':>9} {'child cpu':>10}  same pixels")
    for key, here_s, alone_s, here_cpu, cpu, same in rows:
        extra = alone_s - here_s
        print(f"{key:<40} {here_s:>7.2f} {alone_s:>8.2f} {extra:>8.2f} {here_cpu:>9.2f} {cpu:>10.2f}  {same}")
    extra = statistics.median(row[2] - row[1] for row in rows)
    extra_cpu = statistics.median(row[4] - row[3] for row in rows)
    geometry = f"{args.frames}x{args.size}x{args.size}"
    print(f"median a suspect: {extra:.2f} s and {extra_cpu:.2f} CPU-s more ({geometry}, {len(rows)} clips)")


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's ended and waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
