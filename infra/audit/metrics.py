"""Reconstruction metrics for video tensors ``(3, F, H, W)`` in ``[-1, 1]``: PSNR and SSIM.

Both map pixels to ``[0, 1]`` first (``(x + 1) / 2``, no clamping) and use a data range of 1.

* PSNR: ``10 · log10(1 / MSE)`` over every pixel of every channel and frame; ``inf`` for identical inputs.
* SSIM: Wang et al. (2004) with an 11×11 Gaussian window (σ = 1.5), K1 = 0.01, K2 = 0.03, computed per frame
  per channel over the "valid" window positions (no padding, as in the reference implementation) and averaged
  over every window position, channel and frame. Frames smaller than 11 pixels use the largest odd window that
  fits. The Gaussian filter is applied separably (rows, then columns) as shifted multiply-adds in float64, per
  channel in strips of ~29 rows at 832 wide (they stay in cache; a float64 ``conv2d`` on CPU is ~10× slower);
  identical inputs give exactly 1.0 (numerator and denominator are then the same products).

Scoring is streamed: `VideoScore.add` takes a chunk of frames at a time (decode-and-verify feeds it the decode's
frames as they reach the CPU), and every frame is reduced on its own and added in frame order, so the result does
not depend on how the frames were chunked (bit for bit: tests/test_decode_chunks.py). `psnr` and `ssim` score
whole tensors the same way, one float64 frame at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03
DATA_RANGE = 1.0
Device = torch.device | str
STRIP_ROWS: int | None = None  # output rows of one SSIM strip on CPU; None: from PARALLEL_GRAIN (see _strip_rows)
PARALLEL_GRAIN = 32768  # at::internal::GRAIN_SIZE: element-wise ops on fewer elements run on the calling thread


def _check(reference: torch.Tensor, test: torch.Tensor) -> None:
    """Both must be (C, F, H, W) video tensors of one shape."""
    if reference.shape != test.shape:
        raise ValueError(f"shapes differ: reference {tuple(reference.shape)}, test {tuple(test.shape)}")
    if reference.ndim != 4 or reference.numel() == 0:
        raise ValueError(f"expected non-empty (C, F, H, W) video tensors, got shape {tuple(reference.shape)}")


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> torch.Tensor:
    """The normalised 1-D Gaussian (size,), float64; the 2-D window is its outer product (separable)."""
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    return g / g.sum()


def window_size(height: int, width: int) -> int:
    """The SSIM window: `WINDOW`, or the largest odd size that fits a smaller frame."""
    return min(WINDOW, height - (height + 1) % 2, width - (width + 1) % 2)


def _blur(images: torch.Tensor, taps: list[float]) -> torch.Tensor:
    """'Valid' separable filtering of (..., H, W) with the 1-D `taps`: rows, then columns."""
    n = len(taps)
    rows = images.shape[-2] - n + 1
    out = images[..., :rows, :] * taps[0]
    for k in range(1, n):
        out.add_(images[..., k : k + rows, :], alpha=taps[k])
    cols = images.shape[-1] - n + 1
    result = out[..., :cols] * taps[0]
    for k in range(1, n):
        result.add_(out[..., k : k + cols], alpha=taps[k])
    return result


def _ssim_strip(x: torch.Tensor, y: torch.Tensor, taps: list[float]) -> float:
    """Sum of the SSIM map of grey images x, y (..., R, W) over their valid window positions.

    var_x + var_y comes from one blur of x² + y²; written this way x == y still gives numerator == denominator
    exactly, and swapping x and y gives the same bits."""
    mu_x, mu_y, squares, cross = (_blur(v, taps) for v in (x, y, x * x + y * y, x * y))
    c1, c2 = (K1 * DATA_RANGE) ** 2, (K2 * DATA_RANGE) ** 2
    mu_xy, mu_sq = mu_x * mu_y, mu_x * mu_x + mu_y * mu_y
    numerator = (2 * mu_xy + c1) * (2 * cross - 2 * mu_xy + c2)
    denominator = (mu_sq + c1) * (squares - mu_sq + c2)
    return float((numerator / denominator).sum())


def _frames(reference: torch.Tensor, test: torch.Tensor, device: Device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each frame (C, H, W) of both, mapped to [0, 1] in float64 on `device`: one frame's copies at a time."""
    for index in range(reference.shape[1]):
        ref, out = (v[:, index].detach().to(device, torch.float64) for v in (reference, test))
        yield (ref + 1) / 2, (out + 1) / 2


def _frame_squared(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.sum((x - y) ** 2))


def _strip_rows(width: int, size: int, device: torch.device) -> int:
    """Output rows of one SSIM strip: on CPU as many as keep a strip's inputs under PyTorch's parallel grain (so
    its many small ops run on the calling thread: with 2 threads on 2 busy cores they took 10× longer), on an
    accelerator the whole frame (fewer launches)."""
    if device.type != "cpu":
        return 1 << 30
    return STRIP_ROWS or max(1, PARALLEL_GRAIN // width - (size - 1))


def _frame_ssim(x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """Sum and count of the SSIM map of one frame (C, H, W) in [0, 1], strip by strip (per channel on CPU)."""
    height, width = x.shape[-2:]
    size = window_size(height, width)
    taps = gaussian_window(size).tolist()
    valid, strip = height - size + 1, _strip_rows(width, size, x.device)
    planes = [(x, y)] if x.device.type != "cpu" else [(x[c : c + 1], y[c : c + 1]) for c in range(x.shape[0])]
    total = 0.0
    for a, b in planes:
        for start in range(0, valid, strip):
            rows = slice(start, min(start + strip, valid) + size - 1)
            total += _ssim_strip(a[:, rows], b[:, rows], taps)
    return total, x.shape[0] * valid * (width - size + 1)


class VideoScore:
    """PSNR and SSIM accumulated over chunks of frames of two (C, F, H, W) videos, `add`-ed in frame order."""

    def __init__(self, device: Device = "cpu") -> None:
        self.device = torch.device(device)
        self.squared, self.ssim_total = 0.0, 0.0
        self.values = self.positions = 0
        self._shape: tuple[int, ...] | None = None

    def add(self, reference: torch.Tensor, test: torch.Tensor) -> None:
        """Score one chunk (C, f, H, W) of each video: every frame on its own, in order."""
        _check(reference, test)
        shape = (reference.shape[0], *reference.shape[2:])
        if self._shape not in (None, shape):
            raise ValueError(f"a chunk of shape {tuple(reference.shape)} does not continue frames of {self._shape}")
        self._shape = shape
        for x, y in _frames(reference, test, self.device):
            self.squared += _frame_squared(x, y)
            part, count = _frame_ssim(x, y)
            self.ssim_total, self.positions = self.ssim_total + part, self.positions + count
        self.values += reference.numel()

    @property
    def psnr(self) -> float:
        """Peak signal-to-noise ratio in dB of the frames so far; inf when every pixel matched."""
        if not self.values:
            raise ValueError("no frames scored")
        return _psnr(self.squared, self.values)

    @property
    def ssim(self) -> float:
        """Mean structural similarity of the frames so far."""
        if not self.positions:
            raise ValueError("no frames scored")
        return self.ssim_total / self.positions


def _psnr(squared: float, values: int) -> float:
    if squared == 0.0:
        return float("inf")
    return 10.0 * math.log10(DATA_RANGE**2 / (squared / values))


def psnr(reference: torch.Tensor, test: torch.Tensor, device: Device = "cpu") -> float:
    """Peak signal-to-noise ratio in dB (data range 1 after mapping [-1, 1] to [0, 1]); inf when identical."""
    _check(reference, test)
    return _psnr(sum(_frame_squared(x, y) for x, y in _frames(reference, test, device)), reference.numel())


def ssim(reference: torch.Tensor, test: torch.Tensor, device: Device = "cpu") -> float:
    """Mean structural similarity over frames and channels (1.0 when identical, symmetric in its arguments).

    On CPU a full-size sample (3 × 33 × 832 × 832) takes ~10 s on one core; pass a CUDA `device` to compute there."""
    _check(reference, test)
    parts = [_frame_ssim(x, y) for x, y in _frames(reference, test, device)]
    return sum(p for p, _ in parts) / sum(n for _, n in parts)
