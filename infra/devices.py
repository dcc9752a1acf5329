"""Device and dtype resolution: CUDA, AWS Neuron (torch-neuronx, where installed), CPU."""

from __future__ import annotations

import functools
import importlib.util
import logging

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


def neuron_available() -> bool:
    """True when torch-neuronx (and its torch_xla) is installed."""
    return importlib.util.find_spec("torch_neuronx") is not None and importlib.util.find_spec("torch_xla") is not None


def resolve_device(name: str) -> torch.device:
    """auto → cuda, else neuron, else cpu. An explicit device that is not there is an error."""
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
