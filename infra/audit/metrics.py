"""Reconstruction metrics for video tensors ``(3, F, H, W)`` in ``[-1, 1]``: PSNR and SSIM.

Both map pixels to ``[0, 1]`` first (``(x + 1) / 2``, no clamping) and use a data range of 1.

* PSNR: ``10 · log10(1 / MSE)`` over every pixel of every channel and frame; ``inf`` for identical inputs.
* SSIM: Wang et al. (2004) with an 11×11 Gaussian window (σ = 1.5), K1 = 0.01, K2 = 0.03, computed per frame
  per channel with a "valid" ``conv2d`` (no padding, as in the reference implementation) and averaged over
  every window position, channel and frame. Frames smaller than 11 pixels use the largest odd window that
  fits. The Gaussian filter is applied separably (rows, then columns), in float64, `FRAME_CHUNK` frames at a
  time; identical inputs give exactly 1.0 (numerator and denominator are then the same products).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03
DATA_RANGE = 1.0
Device = torch.device | str
FRAME_CHUNK = 8  # frames converted to float64 at a time


def _check(reference: torch.Tensor, test: torch.Tensor) -> None:
    """Both must be (C, F, H, W) video tensors of one shape."""
    if reference.shape != test.shape:
        raise ValueError(f"shapes differ: reference {tuple(reference.shape)}, test {tuple(test.shape)}")
    if reference.ndim != 4 or reference.numel() == 0:
        raise ValueError(f"expected non-empty (C, F, H, W) video tensors, got shape {tuple(reference.shape)}")


def _chunks(reference: torch.Tensor, test: torch.Tensor, device: Device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`FRAME_CHUNK` frames at a time, mapped to [0, 1] in float64 on `device` (bounded memory at full size)."""
    _check(reference, test)
    for start in range(0, reference.shape[1], FRAME_CHUNK):
        ref, out = (v[:, start : start + FRAME_CHUNK].detach().to(device, torch.float64) for v in (reference, test))
        yield (ref + 1) / 2, (out + 1) / 2


def psnr(reference: torch.Tensor, test: torch.Tensor, device: Device = "cpu") -> float:
    """Peak signal-to-noise ratio in dB (data range 1 after mapping [-1, 1] to [0, 1]); inf when identical."""
    squared = sum(float(torch.sum((ref - out) ** 2)) for ref, out in _chunks(reference, test, device))
    if squared == 0.0:
        return float("inf")
    return 10.0 * math.log10(DATA_RANGE**2 / (squared / reference.numel()))


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> torch.Tensor:
    """The normalised 1-D Gaussian (size,), float64; the 2-D window is its outer product (separable)."""
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    return g / g.sum()


def _blur(images: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """'Valid' Gaussian filtering of (N, 1, H, W): rows, then columns."""
    return F.conv2d(F.conv2d(images, g.view(1, 1, -1, 1)), g.view(1, 1, 1, -1))


def _ssim_sum(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> tuple[float, int]:
    """Sum and count of the SSIM map of grey images x, y (N, 1, H, W)."""
    mu_x, mu_y = _blur(x, g), _blur(y, g)
    var_x = _blur(x * x, g) - mu_x * mu_x
    var_y = _blur(y * y, g) - mu_y * mu_y
    cov = _blur(x * y, g) - mu_x * mu_y
    c1, c2 = (K1 * DATA_RANGE) ** 2, (K2 * DATA_RANGE) ** 2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    ratio = numerator / denominator
    return float(ratio.sum()), ratio.numel()


def ssim(reference: torch.Tensor, test: torch.Tensor, device: Device = "cpu") -> float:
    """Mean structural similarity over frames and channels (1.0 when identical, symmetric in its arguments).

    On CPU a full-size sample (3 × 33 × 832 × 832) takes ~40 s on 2 cores; pass a CUDA `device` to compute there."""
    height, width = reference.shape[-2:]
    size = min(WINDOW, height - (height + 1) % 2, width - (width + 1) % 2)  # the largest odd window that fits
    g = gaussian_window(size).to(device)
    total, count = 0.0, 0
    for ref, out in _chunks(reference, test, device):
        part, n = _ssim_sum(ref.reshape(-1, 1, height, width), out.reshape(-1, 1, height, width), g)
        total, count = total + part, count + n
    return total / count
