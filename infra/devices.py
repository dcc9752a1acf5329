"""Device and dtype resolution: CUDA, AWS Neuron (torch-neuronx, where installed), CPU."""

from __future__ import annotations

import importlib.util
import logging

import torch

from infra.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
