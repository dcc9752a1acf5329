"""Every GPU of a host: where the shard tasks run (`infra.devices.placement`, `DeviceSlots`), ``--devices`` checked
(one line, exit 2), and a build placed on two of three stand-in GPUs (`STANDIN_ENV`: CUDA devices that compute on
the CPU here) whose shard tasks each encode on the device they were given."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from flows.terminal_run import run_build
from infra.devices import STANDIN_ENV, DeviceSlots, placement, visible_accelerators
from infra.errors import ConfigError
from infra.ops.runners import remote_options
from tests.conftest import config, make_shards, sample

ROOT = Path(__file__).resolve().parents[1]
GPUS, SHARDS = 8, 20


def test_cuda_is_every_visible_gpu_or_the_ones_named() -> None:
    assert placement("cuda", None, GPUS) == [f"cuda:{i}" for i in range(GPUS)]
    assert placement("cuda", "0,2", GPUS) == ["cuda:0", "cuda:2"]
    assert placement("cuda", " 5, 1 ", GPUS) == ["cuda:5", "cuda:1"]
    assert placement("cpu", None, GPUS) == ["cpu"] and placement("neuron", None, 0) == ["neuron"]
    for bad in ("0,0", "a", "", "1,", "-1", "8"):
        with pytest.raises(ConfigError, match="--devices"):
            placement("cuda", bad, GPUS)
    with pytest.raises(ConfigError, match="only for --device cuda"):
        placement("cpu", "0", GPUS)


def test_each_gpu_gets_a_task_before_any_gets_two_and_a_freed_gpu_takes_the_next() -> None:
    slots = DeviceSlots(placement("cuda", None, GPUS))
    first = [slots.take() for _ in range(GPUS)]
    assert first == [f"cuda:{i}" for i in range(GPUS)]
    assert Counter(slots.take() for _ in range(GPUS)) == Counter(first)  # --workers 16: two a GPU
    for device in ("cuda:3", "cuda:3", "cuda:6"):
        slots.give(device)
    assert [slots.take(), slots.take(), slots.take()] == ["cuda:3", "cuda:3", "cuda:6"]


def test_shards_and_chunks_spread_over_the_named_gpus_as_tasks_end() -> None:
    slots, placed = DeviceSlots(placement("cuda", "0,2,5", GPUS)), []
    running: list[str] = []
    for _ in range(SHARDS):  # three at once; the oldest ends before the next starts
        if len(running) == 3:
            slots.give(running.pop(0))
        running.append(slots.take())
        placed.append(running[-1])
    assert Counter(placed) == {"cuda:0": 7, "cuda:2": 7, "cuda:5": 6}


def test_on_ray_each_task_asks_for_a_gpu_of_its_own(tmp_path) -> None:
    cfg = config(tmp_path, tmp_path, tmp_path / "out", device="cuda", runner="ray")
    assert remote_options(cfg)["num_gpus"] == 1


def test_a_bad_device_list_is_one_line_and_exit_2(tmp_path, tiny_model) -> None:
    src = make_shards(tmp_path / "src", {"s0": [sample(0, 0, None, b"x")]})
    env = {**os.environ, STANDIN_ENV: "cpu:3"}  # three GPUs: 0, 1, 2
    for bad, says in (("0,0", "distinct"), ("x", "devices"), ("0,3", "no CUDA device 3 here (3 visible: 0-2)")):
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(tiny_model),
             "--out", str(tmp_path / "out"), "--device", "cuda", "--devices", bad],
            capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr


def test_a_build_places_its_shard_tasks_on_the_named_gpus(tmp_path, tiny_model, clips, monkeypatch, caplog) -> None:
    monkeypatch.setenv(STANDIN_ENV, "cpu:3")  # three CUDA devices, computing on the CPU
    assert visible_accelerators("cuda") == 3
    shards = {f"s{i}": [sample(i % 2, i, clips["carphone"], f"prompt {i}".encode())] for i in range(4)}
    src = make_shards(tmp_path / "src", shards)
    caplog.set_level(logging.INFO, logger="infra.preprocess.shard")
    ok, result = run_build(config(src, tiny_model, tmp_path / "out", device="cuda", devices="0,2", workers=1))
    assert ok and result["done"] == 4, result
    placed = [r.getMessage().rsplit(" ", 1)[1] for r in caplog.records if "on device" in r.getMessage()]
    # --workers 1, two GPUs: a task on each at once, the next shard to whichever frees first (2+2 or 3+1 under load)
    assert len(placed) == 4 and set(Counter(placed)) == {"cuda:0", "cuda:2"}, placed
