"""bench/gpu.sh's script on its CPU path (tiny configs, tiny geometry): it runs and prints its summary line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_bench_runs_on_cpu_with_a_tiny_config(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module
    spec.loader.exec_module(module)
    argv = ["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--samples", "2", "--frames", "5"]
    line = module.main([*argv, "--height", "32", "--width", "32", "--tiny-dir", str(tmp_path / "tiny")])
    assert line.startswith("gpu-bench: device=cpu size=tiny geometry=5x32x32 samples=2 s/sample=")
    busy = float(line.split("busy=")[1].split("%")[0])
    assert 0 < busy <= 100
    assert (ROOT / "bench" / "gpu.sh").stat().st_mode & 0o111
