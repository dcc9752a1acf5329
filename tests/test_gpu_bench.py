"""bench/gpu.sh's script on its CPU path: the real `latentforge build` on real clips with the tiny snapshot (the same
builder at its tiny size), tiny geometry; its summary line carries the leg's figures, the busy fraction taken from
the build's own timing hook (``LATENTFORGE_ENCODE_TIMING``). And bench/gpu_encode_bench.py's CPU path."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from bench import gpu_encode_bench
from bench.gpu_bench import SmiSampler, main, union_within
from infra.demo.tiny import TINY_UMT5, TINY_VAE_OVERRIDES, UMT5_XXL
from infra.models.wan_constants import WAN22_VAE_CONFIG
from infra.preprocess.timing import ENV, encode_timing, read_timings

ROOT = Path(__file__).resolve().parents[1]
LEG = re.compile(
    r"\| vb2: s/sample=(?P<s>[\d.]+) busy=(?P<busy>[\d.]+)% \(hook: (?P<clock>[\w-]+), (?P<calls>\d+) calls\) "
    r"enc=(?P<enc>[\d.]+)s smi=(?P<smi>\S+) peak=(?P<peak>\S+) run=\d+s(?: held-by=(?P<held>[^|]+))? \|"
)
SAMPLES = 4


@pytest.mark.soak  # tens of seconds of real builds: make soak (the suite stays under 15 minutes)
def test_the_gpu_bench_runs_the_build_on_cpu_with_the_tiny_snapshot(tmp_path) -> None:
    argv = ["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--frames", "5", "--height", "32"]
    argv += ["--width", "32", "--samples", str(SAMPLES), "--shards", "2", "--video-batches", "2"]
    line = main([*argv, "--decode-workers", "1", "--clips", "sample_1080p", "carphone", "--work", str(tmp_path)])
    assert line.startswith("gpu-bench: device=cpu size=tiny geometry=5x32x32 samples=4 shards=2 decode-workers=1 ")
    assert float(re.search(r" decode=([\d.]+)core-s/clip \|", line)[1]) > 0  # the decode bound, measured here
    leg = LEG.search(line)
    assert leg is not None, line
    assert float(leg["s"]) > 0
    assert leg["clock"] == "host"  # the hook's spans: on a CPU, the encode calls' wall time
    assert 0 < float(leg["busy"]) <= 100
    assert abs(float(leg["enc"]) - float(leg["s"]) * float(leg["busy"]) / 100) < 0.002  # the encode bound
    assert int(leg["calls"]) == SAMPLES + 1  # every sample's encode, and the one-sample sanity's
    assert (leg["smi"], leg["peak"]) == ("n/a", "n/a")  # no nvidia-smi, no CUDA here
    assert re.search(r"\| setup=\d+s total=\d+s ", line)
    assert (tmp_path / "model-tiny" / "model_index.json").exists()  # the snapshot is kept for the next run
    assert not list(tmp_path.glob("run-*"))  # the run's own clips and caches are not
    assert (ROOT / "bench" / "gpu.sh").stat().st_mode & 0o111


def test_overlapping_encoder_spans_count_once_and_only_inside_the_window() -> None:
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (9.0, 12.0)]  # two shard threads' spans overlap on [1, 2]
    assert union_within(spans, 1.5, 10.0) == 1.5 + 1.0 + 1.0


def test_the_timing_hook_records_only_when_asked(tmp_path, monkeypatch) -> None:
    log = tmp_path / "spans"
    monkeypatch.delenv(ENV, raising=False)
    with encode_timing("cpu"):
        pass
    assert not log.exists()
    monkeypatch.setenv(ENV, str(log))
    with encode_timing("cpu"):
        pass
    (span,) = read_timings(log)
    assert span["clock"] == "host" and span["start"] <= span["end"] and span["peak_bytes"] is None


def test_the_nvidia_smi_sampler_reads_each_poll(tmp_path, monkeypatch) -> None:
    # No GPU here: an `nvidia-smi` on PATH that answers as the real one does to the sampler's query.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '57, 2048'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    start = time.time()
    with SmiSampler(interval_s=0.05) as smi:
        time.sleep(0.5)
    assert len(smi.samples) >= 2
    assert smi.mean_util(start, time.time()) == 57.0 and smi.max_used_gib() == 2.0
    assert smi.mean_util(0.0, 1.0) is None  # no sample in that window


def test_the_gpu_encode_bench_times_the_builds_models_on_cpu() -> None:
    """bench/gpu_encode_bench.py reads the configs `make_wan22` builds from (without importing their modules: a GPU
    host may lack the project's other dependencies) and, on its CPU path, times every video batch and the text."""
    vae, text = gpu_encode_bench.project_configs("full")
    assert text == UMT5_XXL and vae == {k: v for k, v in WAN22_VAE_CONFIG.items() if k != "clip_output"}
    vae, text = gpu_encode_bench.project_configs("tiny")
    assert TINY_VAE_OVERRIDES.items() <= vae.items() and TINY_UMT5.items() <= text.items()
    line = gpu_encode_bench.main(["--device", "cpu", "--size", "tiny", "--geometry", "9", "64", "64", "--reps", "1"])
    assert line.startswith("gpu-encode: device=cpu size=tiny geometry=9x64x64 dtype=bf16 | vb1: ")
    clips = [float(x) for x in re.findall(r"vb[124]: ([\d.]+) s/clip", line)]
    text_s = float(re.search(r"text: ([\d.]+) s/prompt", line)[1])
    assert len(clips) == 3 and all(s > 0 for s in clips) and text_s > 0
    assert abs(float(re.search(r"E=([\d.]+) s/sample", line)[1]) - (min(clips) + text_s)) < 0.002
