"""Memory options of a loaded family: VAE tiling and slicing, the text encoder in int8, the text encoder parked
off the device between phases (``--vae-tiling``, ``--vae-slicing``, ``--text-quantize``, ``--text-offload``).

Tiling and int8 change the numbers (they are in the fingerprint); slicing and parking do not. Parking moves the text
encoder to host memory when the device is an accelerator, and frees it on CPU (the family reloads it from its
files when a prompt needs it again: `LoadedFamily.load_text_encoder`). Shards share one loaded family: the encoder
is parked when the last shard using it is done with it. A family whose VAE waits off the device until a clip needs
it (h3: its conditioner and float32 VAE do not fit one 24 GB card together) has ``release_vae``, called before the
text encoder comes back: text and video stages then take turns on the device.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from infra.errors import ConfigError, QuantizeOffCpu
from infra.models.base import LoadedFamily

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """What is done to a family once loaded (part of the process's load cache key: never shared across options)."""

    vae_tiling: bool = False
    vae_slicing: bool = False
    text_quantize: str = "none"
    #: A family whose text encoder may be parked is its own instance (parking frees it on CPU).
    text_offload: bool = False
    #: Gemma loaded in 8-bit by bitsandbytes (the family's `load` does it: the weights are quantized as they load).
    text_8bit: bool = False


def apply(loaded: LoadedFamily, options: LoadOptions) -> None:
    """Turn the options on for a family just loaded; ConfigError for one it cannot do."""
    if options.vae_tiling or options.vae_slicing:
        loaded.set_vae_memory(tiling=options.vae_tiling, slicing=options.vae_slicing)
    if options.text_quantize == "int8-dynamic":
        loaded.text_encoder = quantized(_text_encoder(loaded), loaded)  # type: ignore[attr-defined]
    loaded.load_options = options  # type: ignore[attr-defined] - a reloaded text encoder is quantized again


def quantized(model: torch.nn.Module, loaded: LoadedFamily) -> torch.nn.Module:
    """The text encoder with its Linear layers in dynamic int8 (torch.ao; float32 elsewhere). CPU only."""
    if loaded.device.type != "cpu":  # type: ignore[attr-defined]
        raise QuantizeOffCpu(loaded.device.type)  # type: ignore[attr-defined]
    # in place, layer by layer: the float weights of a layer are freed as its int8 one replaces it
    return torch.ao.quantization.quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def _text_encoder(loaded: LoadedFamily) -> torch.nn.Module:
    model = getattr(loaded, "text_encoder", None)
    if model is None:
        raise ConfigError(f"family {loaded.name}: this model has no text encoder")
    return model


class _Parking:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.users = 0
        self.parked = False


_state: weakref.WeakKeyDictionary[LoadedFamily, _Parking] = weakref.WeakKeyDictionary()
_state_lock = threading.Lock()


def _parking(loaded: LoadedFamily) -> _Parking:
    with _state_lock:
        return _state.setdefault(loaded, _Parking())


@contextlib.contextmanager
def text_in_use(loaded: LoadedFamily) -> Iterator[None]:
    """The text encoder on its device while the block runs (brought back if parked); parked again when the last
    user leaves."""
    state = _parking(loaded)
    with state.lock:
        state.users += 1
        if state.parked:
            _unpark(loaded)
            state.parked = False
    try:
        yield
    finally:
        with state.lock:
            state.users -= 1
            if state.users == 0:
                _park(loaded)
                state.parked = True


def is_parked(loaded: LoadedFamily) -> bool:
    """Whether the family's text encoder is off its device now."""
    return _parking(loaded).parked


def _park(loaded: LoadedFamily) -> None:
    model = _text_encoder(loaded)
    device = loaded.device  # type: ignore[attr-defined]
    if device.type != "cpu":
        model.to("cpu")
    else:
        loaded.text_encoder = None  # type: ignore[attr-defined]
        del model
        gc.collect()
    logger.info("text encoder of %s parked (%s)", loaded.name, "freed" if device.type == "cpu" else "on the host")


def _unpark(loaded: LoadedFamily) -> None:
    device = loaded.device  # type: ignore[attr-defined]
    if callable(release := getattr(loaded, "release_vae", None)):  # a family whose stages take turns on the device
        release()
    if device.type != "cpu":
        _text_encoder(loaded).to(device)
        return
    model: Any = loaded.load_text_encoder()
    options: LoadOptions = getattr(loaded, "load_options", LoadOptions())
    loaded.text_encoder = quantized(model, loaded) if options.text_quantize == "int8-dynamic" else model  # type: ignore[attr-defined]
    logger.info("text encoder of %s loaded again from its files", loaded.name)
