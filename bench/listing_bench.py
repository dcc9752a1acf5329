"""Build and resume time of a source whose listing dominates: one VBVR tar of 10^4 members (5,000 samples), of which
a build encodes the first four (``--limit 4``, tiny geometry, the tiny model): every listing of the shard reads its
10^4 headers, so the build's and the resume's seconds show how many times the build lists it.

The same workload runs on two revisions of latentforge, each in a fresh process with its tree first on PYTHONPATH:
``--old`` (a checkout, by default a `git worktree` of ``c800fb4`` made under the bench's temp folder: the code before
the source was listed once a step) and this tree. Each child builds into a new OUT, then runs the same build again (a
resume: everything done), and prints its seconds, how many times it listed (the counting source registered by the
child, `CountedSource`) and the sha256 of every file of OUT (but reports/ and the lock, and each ledger row's run
id and seconds, cache.json's creation time): the two revisions' files must be the same bytes.

    python bench/listing_bench.py                 # about three minutes on 2 cores
    python bench/listing_bench.py --members 2000  # smaller
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "c800fb4"
GEOMETRY = {"frames": 17, "height": 48, "width": 80}
GENERATOR, TASK = "G-11_handle_object_reappearance_data-generator", "handle_object_reappearance"


def _source(root: Path, members: int, clip: bytes) -> Path:
    """One VBVR tar of `members` members (a video and a prompt a sample); the first four videos real, the rest one
    byte (never read: past the build's limit)."""
    from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: PLC0415 - the parent's tree

    samples = (
        DemoSample(
            GENERATOR,
            TASK,
            i,
            {"ground_truth.mp4": clip if i < 4 else b"x", "prompt.txt": f"sample {i} of the bench".encode()},
        )
        for i in range(members // 2)
    )
    src = root / "src"
    src.mkdir(parents=True)
    write_vbvr_tar(src / "G-11_part-00000.tar", samples, dir_entries=False)
    return src


def _clip(root: Path) -> bytes:
    """A real demo clip's bytes (make-demo-data's first)."""
    import tarfile  # noqa: PLC0415

    from infra.demo.data import make_demo_data  # noqa: PLC0415

    tar = make_demo_data(root / "demo", n_shards=1, with_bad_sample=False)[0]
    with tarfile.open(tar) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("ground_truth.mp4"))
        return tf.extractfile(member).read()  # type: ignore[union-attr]


def _hashes(out: Path) -> dict[str, str]:
    """sha256 of OUT's files (relative path → hex; the JSON ones' text too), but reports/ and the lock, with each
    ledger row's run id and seconds and cache.json's creation time left out (what differs from run to run)."""
    found = {}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if not path.is_file() or rel.parts[0] == "reports" or path.name == ".latentforge.lock":
            continue
        data = path.read_bytes()
        if rel.parts[0] == "ledger" and path.suffix == ".jsonl" and "plan" not in rel.parts:
            rows = [json.loads(line) for line in data.splitlines()]
            for row in rows:
                row.pop("seconds", None)
                row.get("extra", {}).pop("run_id", None)
            data = b"\n".join(json.dumps(row).encode() for row in rows)
        elif str(rel) == "cache.json":
            meta = json.loads(data)
            meta.get("provenance", {}).pop("created", None)
            data = json.dumps(meta).encode()
        found[str(rel)] = hashlib.sha256(data).hexdigest()
        if path.suffix in (".json", ".jsonl"):
            found[f"{rel} (text)"] = data.decode(errors="replace")
    return found


def child(tree: str, src: str, model: str, out: str) -> None:
    """One revision's build and resume (this process's PYTHONPATH is `tree`); prints a JSON line."""
    import importlib  # noqa: PLC0415
    import logging  # noqa: PLC0415

    from prefect.testing.utilities import prefect_test_harness  # noqa: PLC0415

    runner = "flows.terminal_run" if (Path(tree) / "flows" / "terminal_run.py").is_file() else "flows.run"  # c800fb4's
    run_build = importlib.import_module(runner).run_build
    from infra.config import BuildConfig  # noqa: PLC0415
    from infra.sources.base import register_source  # noqa: PLC0415
    from infra.sources.vbvr import VbvrSource  # noqa: PLC0415

    assert Path(sys.modules[runner].__file__).is_relative_to(tree), "the child runs another tree"
    logging.disable(logging.WARNING)
    calls: Counter[str] = Counter()

    @register_source("counted")
    class CountedSource(VbvrSource):
        def shards(self):  # type: ignore[no-untyped-def]
            calls["shards()"] += 1
            return super().shards()

        def samples(self, shard):  # type: ignore[no-untyped-def]
            calls[f"samples({shard.id})"] += 1
            return super().samples(shard)

    config = BuildConfig(
        source=f"counted:{src}", model=model, out=out, device="cpu", dtype="fp32", decode_samples=0, workers=1,
        on_loss="accept", on_conflict="abort", on_stale="abort", limit=4, **GEOMETRY,
    )  # fmt: skip
    result: dict[str, object] = {}
    with prefect_test_harness(server_startup_timeout=180):
        for step in ("build", "resume"):
            calls.clear()
            start = time.perf_counter()
            ok, summary = run_build(config)
            assert ok, summary
            result[step] = {"seconds": round(time.perf_counter() - start, 2), "listings": dict(calls)}
    result["hashes"] = _hashes(Path(out))
    print("RESULT " + json.dumps(result))


def _run(tree: Path, src: Path, model: Path, out: Path, home: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PREFECT_HOME": str(home)}
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    args = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), str(src), str(model), str(out)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: the child failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--old", type=Path, help=f"a checkout of the code before (default: {OLD_REV}, a worktree)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    sys.path.insert(0, str(ROOT))
    from infra.demo.tiny import make_tiny_wan22  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="lf-listing-bench-") as tmp:
        root = Path(tmp)
        old = args.old
        if old is None:
            old = root / "old"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), OLD_REV], check=True)
        try:
            src = _source(root, args.members, _clip(root))
            model = make_tiny_wan22(root / "model", seed=0)
            found = {}
            for name, tree in (("old", old), ("new", ROOT)):
                found[name] = _run(tree.resolve(), src, model, root / f"out-{name}", root / f"prefect-{name}")
        finally:
            if args.old is None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    print(f"one tar of {args.members} members ({args.members // 2} samples), --limit 4, {GEOMETRY}")
    print(f"{'step':<8}{'old s':>8}{'new s':>8}{'new/old':>9}  listings old → new")
    for step in ("build", "resume"):
        o, n = found["old"][step], found["new"][step]
        print(f"{step:<8}{o['seconds']:>8.2f}{n['seconds']:>8.2f}{n['seconds'] / o['seconds']:>9.2f}  "
              f"{o['listings']} → {n['listings']}")  # fmt: skip
    same = found["old"]["hashes"] == found["new"]["hashes"]
    files = [rel for rel in found["new"]["hashes"] if not rel.endswith(" (text)")]
    print(f"OUT's files: {len(files)}, {'the same bytes' if same else 'DIFFERENT'}")
    if not same:
        old_h, new_h = found["old"]["hashes"], found["new"]["hashes"]
        for rel in sorted(old_h.keys() | new_h.keys()):
            if old_h.get(rel) != new_h.get(rel) and not rel.endswith(" (text)"):
                print(f"  differs: {rel}")
                text = f"{rel} (text)"
                if text in old_h or text in new_h:
                    for a, b in zip(old_h.get(text, "").split(","), new_h.get(text, "").split(","), strict=False):
                        if a != b:
                            print(f"    old {a!r}\n    new {b!r}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
