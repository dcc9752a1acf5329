"""Device and dtype resolution: CUDA, AWS Neuron (torch-neuronx, where installed), CPU."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import Sequence

import torch

from infra.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: The intra-op threads torch encodes with on CPU, wherever the encode runs (a thread of the local runner, a Ray
#: worker given one CPU, another host): PyTorch's CPU kernels split their work, and pick their algorithm, by the
#: thread count (a 1×1 convolution goes through oneDNN only on more than one thread), so one clip's latents differ
#: in the last bits between 1, 2, 3 and 4 threads (measured: the tiny Wan2.2 VAE at 33×128², fp32). Fixed, not
#: taken from the machine, so every runner computes the same bytes; 2 is what a default build on a 2-core machine
#: has always used.
CPU_THREADS = 2
#: Tests only: ``cpu:N`` makes N stand-in CUDA devices that compute on the CPU, so a CPU machine runs a build
#: placed on several GPUs through the public interface (`resolve_device`, `visible_accelerators`).
STANDIN_ENV = "LATENTFORGE_DEVICE_STANDIN"
DEVICE_LIST = re.compile(r"^\d+(,\d+)*$")


def _standin() -> tuple[str, int] | None:
    value = os.environ.get(STANDIN_ENV)
    if not value:
        return None
    device, _, count = value.partition(":")
    return device, int(count or 1)


def parse_devices(text: str) -> tuple[int, ...]:
    """``0,2`` → (0, 2): distinct indices, in the order given; ConfigError for anything else."""
    text = text.replace(" ", "")
    indices = tuple(int(part) for part in text.split(",")) if DEVICE_LIST.match(text) else ()
    if not indices or len(set(indices)) != len(indices):
        raise ConfigError(f"--devices {text!r}: give distinct device indices separated by commas, e.g. 0,2")
    return indices


def visible_accelerators(kind: str) -> int:
    """How many `kind` devices this process sees (CUDA: torch's count; a stand-in's count under `STANDIN_ENV`)."""
    standin = _standin()
    if standin is not None and kind == "cuda":
        return standin[1]
    return torch.cuda.device_count() if kind == "cuda" else 1


def placement(device: str, devices: str | None, visible: int) -> list[str]:
    """The devices a build's shard tasks are placed on: ``--device cuda`` on a host with `visible` GPUs is every one
    of them (``cuda:0`` ... ``cuda:N-1``), or those `devices` names (``0,2``); any other device is itself alone.
    ConfigError for an index the host does not have, or `devices` with a device that has none."""
    if device != "cuda":
        if devices is not None:
            raise ConfigError(f"--devices {devices}: only for --device cuda (this run's device is {device})")
        return [device]
    indices = parse_devices(devices) if devices is not None else tuple(range(visible))
    missing = [index for index in indices if index >= visible]
    if missing:
        raise ConfigError(f"--devices {devices}: no CUDA device {missing[0]} here ({visible} visible: 0-{visible - 1})")
    return [f"cuda:{index}" for index in indices] or ["cuda"]


class DeviceSlots:
    """Which device the next shard task runs on: the one with the fewest tasks running (the first of them on a tie),
    so N devices each get a task before any gets two, and a finished task's device takes the next."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.running = dict.fromkeys(devices, 0)

    def take(self) -> str:
        device = min(self.running, key=lambda name: self.running[name])  # the first of the least busy
        self.running[device] += 1
        return device

    def give(self, device: str) -> None:
        self.running[device] -= 1


def bind_thread(device: str) -> None:
    """Make `device` (``cuda:N``) the calling thread's current CUDA device: what its CUDA events, streams and memory
    counters refer to (the current device is per thread). Others are left alone."""
    if device.startswith("cuda:") and _standin() is None:
        torch.cuda.set_device(torch.device(device))


def neuron_available() -> bool:
    """True when torch-neuronx (and its torch_xla) is installed."""
    return importlib.util.find_spec("torch_neuronx") is not None and importlib.util.find_spec("torch_xla") is not None


def resolve_device(name: str) -> torch.device:
    """auto → cuda, else neuron, else cpu. An explicit device that is not there is an error."""
    standin = _standin()
    if standin is not None and name.split(":")[0] in ("cuda", "auto"):
        return torch.device(standin[0])  # tests only (`STANDIN_ENV`): the stand-in accelerators compute here
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "neuron" if neuron_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch")
    if name == "neuron":
        if not neuron_available():
            raise ConfigError("--device neuron: torch-neuronx is not installed (pip install torch-neuronx)")
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional, Neuron hosts only

        return xm.xla_device()
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    """bf16 | fp32 → torch dtype."""
    try:
        return DTYPES[name]
    except KeyError as exc:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from exc


@functools.cache
def _is_cpu(name: str) -> bool:
    return resolve_device(name).type == "cpu"


def pin_cpu_threads(device: str) -> None:
    """On a CPU run (`device` as configured: cpu, or auto without an accelerator), make torch compute in the calling
    thread with `CPU_THREADS` intra-op threads (an OpenMP thread's team size is its own: each thread that encodes
    sets it). Other devices are left alone."""
    if _is_cpu(device) and torch.get_num_threads() != CPU_THREADS:
        torch.set_num_threads(CPU_THREADS)
