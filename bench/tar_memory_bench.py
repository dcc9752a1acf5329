"""Memory per listed sample of one big tar: peak RSS of the plan, the recorded plan and reconcile, per sample.

Workload: one VBVR tar of N members (N/2 samples: an empty ``ground_truth.mp4`` and a one-byte ``prompt.txt``
each; listing reads headers only, so the payload does not matter), at 10^4 and 10^5 members (``--full``: 10^6).
Each step is a fresh process whose peak RSS comes from ``wait4``; what a process that imports the same modules and
lists nothing peaks at (``imports``) is taken off, and the rest divided by the samples listed:

* ``tarfile``: the baseline, a plain `tarfile` listing (``for info in tarfile.open(...)``), which keeps every
  header in ``TarFile.members`` as any tarfile listing does; latentforge's listing before this bench's change
  kept those headers and more (1.9 KB a sample listed, against tarfile's 1.2 KB, measured here before the change);
* ``plan``: `infra.plan.make_plan` with a spool (the tar listed, samples counted, output names checked across
  shards, each planned sample written to the spool);
* ``recorded``: that spool recorded in OUT (`infra.cache.listing.install`) and read back shard by shard;
* ``reconcile``: `infra.audit.reconcile.reconcile` of that OUT against its recorded plan, nothing listed again
  (nothing built: every planned sample is in the report, ``not_processed``: the worst case of its list).

Printed: a table per size with peak RSS (MiB), bytes per listed sample and the ratio against ``tarfile``; goal:
a 10^6-member tar planned, recorded and reconciled in < 2 GiB each.

    python bench/tar_memory_bench.py              # 10^4 and 10^5 members (about a minute on 2 cores)
    python bench/tar_memory_bench.py --full       # and 10^6 (the tar is ~1 GB; several minutes)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.feed_family import make_model  # noqa: E402

FAMILY = "bench.feed_family:FeedFamily"
GENERATOR, TASK = "G-11_handle_object_reappearance_data-generator", "handle_object_reappearance"
STEPS = ("imports", "tarfile", "plan", "recorded", "reconcile")
GOAL_MIB = 2048

logger = logging.getLogger("tar_memory_bench")


def write_tar(path: Path, members: int) -> Path:
    """One VBVR tar of `members` members (two a sample), headers as tarfile writes them (written once per size)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with tarfile.open(partial, "w", format=tarfile.GNU_FORMAT) as tf:
        for index in range(members // 2):
            directory = f"{GENERATOR}/{TASK}_task/{TASK}_{index:08d}"
            for name, size in (("ground_truth.mp4", 0), ("prompt.txt", 1)):
                info = tarfile.TarInfo(f"{directory}/{name}")
                info.size, info.mtime = size, 1_704_067_200
                tf.addfile(info, _Zeros(size))
            tf.members.clear()  # the writer keeps its headers too; at 10^6 that would be the bench's own GiB
    partial.rename(path)
    return path


class _Zeros:
    def __init__(self, size: int) -> None:
        self.left = size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return b"p" * n


def _config(root: Path, members: int) -> object:
    from infra.config import BuildConfig  # noqa: PLC0415 - heavy: the child only

    values = {"source": f"vbvr:{root / f'src-{members}'}", "model": str(root / "model"), "family": FAMILY}
    values |= {"out": str(root / f"out-{members}"), "frames": 2, "height": 32, "width": 32, "device": "cpu"}
    return BuildConfig(**values)


def child(step: str, root: Path, members: int) -> dict:
    """One step in this fresh process; what it found (its peak RSS is the parent's to read)."""
    from infra.audit.reconcile import reconcile  # noqa: PLC0415 - heavy: the child only
    from infra.cache import listing  # noqa: PLC0415
    from infra.plan import make_plan, recorded_plan  # noqa: PLC0415

    config = _config(root, members)
    tar = root / f"src-{members}" / "big.tar"
    if step == "imports":
        return {"samples": 0}
    if step == "tarfile":
        with tarfile.open(tar) as tf:
            return {"samples": sum(1 for info in tf if info.name.endswith("prompt.txt"))}
    spool, out = root / f"spool-{members}", Path(config.out)
    if step == "plan":  # the spool and the plan's shards are left for the next steps
        shutil.rmtree(spool, ignore_errors=True)
        plan = make_plan(config, spool)
        (root / f"shards-{members}.json").write_text(json.dumps([s.model_dump(mode="json") for s in plan.shards]))
        return {"samples": sum(s.samples for s in plan.shards)}
    if step == "recorded":
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        shards = json.loads((root / f"shards-{members}.json").read_text())
        listing.install(out, spool, shards)
        return {"samples": sum(len(listing.read_listing(out, s["id"]) or []) for s in shards)}
    recorded = recorded_plan(config)
    report = reconcile(recorded.job, recorded.shards, recorded.source_shards)  # the OUT the recorded step left
    return {"samples": report.expected, "headline": report.headline()}


def run_step(step: str, root: Path, members: int) -> dict:
    """`step` in a fresh process: what it reports and its peak RSS (MiB)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    env["PREFECT_HOME"] = str(root / "prefect")
    command = [sys.executable, __file__, "--child", step, str(root), str(members)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{step} at {members} members failed:\n{stderr[-3000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "peak_mib": usage.ru_maxrss / 1024}


def measure(root: Path, members: int) -> dict[str, dict]:
    write_tar(root / f"src-{members}" / "big.tar", members)
    results = {step: run_step(step, root, members) for step in STEPS}
    base = results["imports"]["peak_mib"]
    for result in results.values():
        samples = result["samples"] or 1
        result["bytes_per_sample"] = (result["peak_mib"] - base) * 2**20 / samples
    return results


def table(members: int, results: dict[str, dict]) -> str:
    baseline = results["tarfile"]["bytes_per_sample"]
    lines = [f"\n{members:,} members ({results['plan']['samples']:,} samples)",
             f"{'step':<10} {'peak MiB':>9} {'B/sample':>9} {'vs tarfile':>10}"]  # fmt: skip
    for step, result in results.items():
        if step == "imports":
            lines.append(f"{step:<10} {result['peak_mib']:>9.0f} {'':>9} {'':>10}")
            continue
        ratio = result["bytes_per_sample"] / baseline if baseline > 0 else float("nan")
        lines.append(f"{step:<10} {result['peak_mib']:>9.0f} {result['bytes_per_sample']:>9.0f} {ratio:>9.2f}×")
    worst = max(r["peak_mib"] for r in results.values())
    lines.append(f"goal: every step < {GOAL_MIB} MiB: {'met' if worst < GOAL_MIB else 'NOT met'} ({worst:.0f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also 10^6 members")
    parser.add_argument("--members", type=int, nargs="*", help="sizes (members) instead of the defaults")
    parser.add_argument("--root", type=Path, help="work folder (kept; tars are reused); default: a temporary one")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, root, members = args.child
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(child(step, Path(root), int(members))))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = args.members or [10_000, 100_000, *([1_000_000] if args.full else [])]
    with tempfile.TemporaryDirectory(prefix="tar-memory-") as tmp:
        root = args.root or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "model").exists():
            make_model(root / "model", 0.0, root / "feed.log")
        for members in sizes:
            logger.info("%s", table(members, measure(root, members)))


if __name__ == "__main__":
    main()
