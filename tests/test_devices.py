"""Devices and dtypes: one code path for cpu, cuda and neuron; placement and casts checked on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from infra.devices import CPU_THREADS, neuron_available, pin_cpu_threads, resolve_device, resolve_dtype
from infra.errors import ConfigError
from infra.models import load_family
from infra.models.base import TextSettings

PIXELS = (1, 3, 5, 32, 32)  # frames ≡ 1 mod 4, sides multiples of 16


def test_auto_is_the_best_device_present_and_cpu_here() -> None:
    want = "cuda" if torch.cuda.is_available() else "xla" if neuron_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_device_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda")


@pytest.mark.skipif(neuron_available(), reason="torch-neuronx is installed")
def test_neuron_without_torch_neuronx_names_the_package() -> None:
    with pytest.raises(ConfigError, match="torch-neuronx is not installed"):
        resolve_device("neuron")


def test_dtypes_and_an_unknown_one() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("fp32") is torch.float32
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_models_are_placed_and_cast_and_outputs_come_back_bf16_on_cpu(tiny_model, dtype) -> None:
    encoder = load_family(tiny_model, "wan22", resolve_device("cpu"), dtype)
    for module in (encoder.vae, encoder.text_encoder):
        assert {p.device.type for p in module.parameters()} == {"cpu"}
        assert {p.dtype for p in module.parameters()} == {dtype}
    pixels = torch.rand(PIXELS, generator=torch.Generator().manual_seed(0)) * 2 - 1  # float32, as the recipe gives
    latents = encoder.encode_video(pixels)
    assert latents.dtype == torch.bfloat16 and latents.device.type == "cpu" and latents.shape[0] == 48
    text = encoder.encode_text("a ball", TextSettings(16))
    assert text.embeds.dtype == torch.bfloat16 and text.embeds.device.type == "cpu"
    decoded = encoder.decode(latents)
    assert decoded.dtype == torch.float32 and decoded.shape == PIXELS[1:]


def test_an_encoding_thread_computes_on_the_pinned_thread_count_whatever_it_started_with() -> None:
    seen, previous = [], torch.get_num_threads()

    def encoding_thread(start: int) -> None:
        torch.set_num_threads(start)  # 1: as a Ray worker given one CPU starts (OMP_NUM_THREADS=1)
        pin_cpu_threads("cpu")
        seen.append(torch.get_num_threads())

    for start in (1, 3):
        worker = threading.Thread(target=encoding_thread, args=(start,))
        worker.start()
        worker.join()
    torch.set_num_threads(previous)  # the process-wide default new threads start with, as it was
    assert seen == [CPU_THREADS, CPU_THREADS]
