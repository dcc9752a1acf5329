"""bench/gpu/shot.py, the GPU shot, on its CPU path at a tiny size: every leg of the device run (the Wan2.2 builds
with decode-and-verify, the plain-loop parity, LTX-2, the 8-bit leg's refusal off CUDA, the CPU fp32 reference),
its JSON written as it goes, and its summary line printed even when the budget stops it."""

from __future__ import annotations

import json

import pytest

from bench.gpu.shot import main

TINY = ["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--frames", "9", "--height", "64", "--width", "64"]
TINY += ["--samples", "4", "--shards", "2", "--decode-workers", "1", "--clips", "sample_1080p", "carphone"]


@pytest.mark.soak  # tens of seconds of real builds: make soak (the suite stays under 15 minutes)
def test_the_shot_runs_every_leg_on_cpu_and_the_build_equals_the_plain_loop(tmp_path) -> None:
    line = main([*TINY, "--work", str(tmp_path / "work"), "--json", str(tmp_path / "shot.json")])
    results = json.loads((tmp_path / "shot.json").read_text())
    assert line.startswith("gpu-shot: device=cpu dtype=fp32 size=tiny geometry=9x64x64 samples=4 | vb1: ")
    assert results["summary"] == line
    for leg in ("setup", "decode", "vb1", "parity", "vb2", "ltx2", "ltx2_8bit", "cpu_fp32"):
        assert "failed" not in results[leg] and "skipped" not in results[leg], (leg, results[leg])
    for leg in ("vb1", "vb2", "ltx2"):
        assert results[leg]["samples"] == 4 and results[leg]["s_per_sample"] > 0  # ltx2: one latents file a sample
        assert 0 < results[leg]["busy"] <= 1 and set(results[leg]["stages"]) == {"encode", "text", "prepare", "write"}
    assert results["vb1"]["decode_verify"]["ok"] and results["vb1"]["decode_verify"]["samples"] == 2
    assert results["parity"]["bit_equal"] and results["parity"]["samples"] == 2  # the 1080p clip among them
    assert "parity(vb1 vs plain loop, 2): bit-equal" in line
    (cpu,) = results["cpu_fp32"]["rows"]  # here the build itself is CPU fp32: zero steps from the reference
    assert cpu["x0_equal"] and cpu["text_embeds_equal"] and cpu["x0_steps_max"] == 0
    assert "refused exit=2" in results["ltx2_8bit"]["line"]  # no CUDA, no bitsandbytes here: the CLI's refusal
    assert line.endswith("budget=480s")


def test_the_shot_prints_its_line_and_json_when_the_budget_is_spent(tmp_path) -> None:
    line = main([*TINY, "--budget-s", "1", "--work", str(tmp_path / "work"), "--json", str(tmp_path / "shot.json")])
    results = json.loads((tmp_path / "shot.json").read_text())
    assert "vb1: " in line and "left of the budget" in results["vb1"]["skipped"]
    assert "skipped" in results["vb2"] and "skipped" in results["ltx2"] and "cpu_fp32" not in results
    assert results["summary"] == line and "setup" in results
