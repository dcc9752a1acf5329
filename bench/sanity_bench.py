"""The one-sample sanity's projection against the real run, measured in the same run: best of three builds
and three projections (each from three repeats) at 33×96×160 with the tiny model on real clips.

Prints the full-run seconds, the projected seconds and their ratio (the sanity's promise: within 2×).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from flows.terminal_run import run_build
from infra.config import BuildConfig
from infra.demo.data import make_demo_data
from infra.demo.tiny import make_tiny_wan22
from infra.plan import make_plan
from infra.preprocess.one_sample import SanityReport, run_sanity

GEOMETRY = {"frames": 33, "height": 96, "width": 160}


def _config(src: Path, model: Path, out: Path) -> BuildConfig:
    return BuildConfig(
        source=f"vbvr:{src}", model=str(model), out=str(out), device="cpu", dtype="fp32", decode_samples=0,
        on_loss="accept", on_conflict="abort", **GEOMETRY,
    )  # fmt: skip


def _sanity(config: BuildConfig, repeats: int = 1) -> SanityReport:
    """The standalone sanity of `config`'s plan."""
    plan = make_plan(config)
    return run_sanity(plan.job, plan.shards, repeats=repeats)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    from prefect.testing.utilities import prefect_test_harness  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="lf-sanity-bench-") as tmp, prefect_test_harness():
        root = Path(tmp)
        src = root / "src"
        make_demo_data(src, n_shards=2, with_bad_sample=False)
        model = make_tiny_wan22(root / "model")
        _sanity(_config(src, model, root / "warm"))  # load the model, pay the first calls
        builds, projections = [], []
        for attempt in range(3):
            ok, summary = run_build(_config(src, model, root / f"out{attempt}"))
            assert ok, summary
            builds.append(summary["seconds"])
            projections.append(_sanity(_config(src, model, root / f"p{attempt}"), repeats=3).projected_seconds)
        full, projected = min(builds), min(projections)
        print(f"full run {full:.2f} s (best of {builds}); projected {projected:.2f} s (best of {projections})")
        print(f"projected / full = {projected / full:.2f}x  (promise: within 0.5x-2x)")


if __name__ == "__main__":
    main()
