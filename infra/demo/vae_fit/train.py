"""Fitting the tiny Wan2.2 VAE to a few clips: the closed-form initialisation, then a short fine-tune."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

from infra.demo.vae_fit.chunks import skip_branches
from infra.demo.vae_fit.linalg import Fitter
from infra.demo.vae_fit.linear_init import init_linear_path

logger = logging.getLogger(__name__)


class ScaledAdam:
    """Adam whose step for each element is multiplied by a fixed scale taken from the initial weights: per input
    channel (RMS of that weight column) for conv weights, per element (|p| + 1% of the tensor RMS) otherwise.
    The closed-form initialisation mixes very different input scales (large constant channels, tiny near-linear
    SiLU features), so one learning rate per tensor would wreck it in a single step; zero columns stay frozen."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas=(0.9, 0.99), eps: float = 1e-12):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.scale, self.m, self.v = [], [], []
        for p in self.params:
            w = p.detach()
            if w.dim() >= 2 and w.shape[1] > 1:
                dims = [d for d in range(w.dim()) if d != 1]
                scale = w.pow(2).mean(dim=dims, keepdim=True).sqrt()
            else:
                scale = w.abs() + 0.01 * w.pow(2).mean().sqrt()
            self.scale.append(scale)
            self.m.append(torch.zeros_like(w))
            self.v.append(torch.zeros_like(w))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr_factor: float = 1.0) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for p, s, m, v in zip(self.params, self.scale, self.m, self.v, strict=True):
            if p.grad is None:
                continue
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.sub_(self.lr * lr_factor * s * (m / c1) / ((v / c2).sqrt() + self.eps))


@dataclass(frozen=True)
class FitSettings:
    """steps of ScaledAdam (cosine schedule, linear warm-up) on random crops of `frames` x `crop` x `crop` from
    the clips, `batch` crops a step, harder clips drawn more often; the closed-form part sees `init_frames`."""

    steps: int = 300
    seed: int = 0
    lr: float = 1e-2
    crop: int = 64
    frames: int = 13
    batch: int = 3
    warmup: int = 10
    init_frames: int = 9
    weight_power: float = 5.0
    threads: int = 2


@dataclass(frozen=True)
class FitResult:
    steps: int
    seconds: float
    init_seconds: float
    crop_psnr: float | None  # the training crops' PSNR over the last tenth of the steps (dB)


def clip_weights(x: torch.Tensor, power: float) -> list[float]:
    """One weight per clip: its error under a 16x average-pool reconstruction, relative to the mean, to the power
    `power`. Detailed clips are the hard ones; they weigh more, since the gate is on the worst clip."""
    n = x.shape[0]
    frames = x.transpose(1, 2).flatten(0, 1)
    up = F.interpolate(F.avg_pool2d(frames, 16), scale_factor=16, mode="bilinear", align_corners=False)
    mse = (up - frames).pow(2).reshape(n, -1).mean(1)
    return ((mse / mse.mean()) ** power).tolist()


def fitted_to(settings: FitSettings, t: int, h: int, w: int) -> FitSettings:
    """`settings` with the crops shrunk to clips of t frames at h x w: frames to the largest 4k + 1 ≤ t, the crop
    to the largest multiple of 16 ≤ min(h, w). ValueError for clips the VAE cannot take."""
    if t < 5 or min(h, w) < 16 or h % 16 or w % 16:
        raise ValueError(
            f"cannot fit the VAE to {t} frames at {h}x{w}: at least 5 frames and 16x16 pixels, sides multiples of 16"
        )
    longest = (t - 1) // 4 * 4 + 1
    crop = min(settings.crop, min(h, w) // 16 * 16)
    return replace(
        settings, frames=min(settings.frames, longest), init_frames=min(settings.init_frames, longest), crop=crop
    )


@torch.no_grad()
def _mse(vae: AutoencoderKLWan, x: torch.Tensor) -> float:
    """Reconstruction MSE of the whole clips' first frames (the judge of whether fine-tuning helped)."""
    was = vae.training
    vae.eval()
    out = torch.stack([vae.decode(vae.encode(c[None]).latent_dist.mode()).sample[0] for c in x])
    vae.train(was)
    return float(F.mse_loss(out, x))


def fit_vae(
    vae: AutoencoderKLWan,
    clips: list[torch.Tensor],
    settings: FitSettings = FitSettings(),
    *,
    on_step: Callable[[int, AutoencoderKLWan], None] | None = None,
) -> FitResult:
    """Fit `vae` (the tiny Wan2.2 VAE, float32) in place to `clips`, each (1, 3, F, H, W) or (3, F, H, W) pixels
    in [-1, 1] at one geometry. Deterministic for a seed on a given machine and thread count."""
    x = torch.stack([c[0] if c.dim() == 5 else c for c in clips]).float().contiguous()
    settings = fitted_to(settings, *x.shape[2:])
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _fit(vae, x, settings, on_step)
    finally:
        torch.set_num_threads(threads)


def _fit(vae, x, settings: FitSettings, on_step) -> FitResult:
    torch.manual_seed(settings.seed)
    started = time.perf_counter()
    weights = clip_weights(x, settings.weight_power)
    fitter = Fitter(weights, torch.Generator().manual_seed(settings.seed))
    blocks = init_linear_path(vae, x[:, :, : settings.init_frames], fitter, log=logger.debug)
    init_seconds = time.perf_counter() - started
    logger.info("closed-form initialisation of the VAE in %.1f s", init_seconds)
    for block in blocks:  # the residual branches stay zero: only their 1x1 shortcuts train, with the linear path
        for p in block.parameters():
            p.requires_grad_(False)
        for p in block.conv_shortcut.parameters():
            p.requires_grad_(True)
    probe = x[:, :, : settings.init_frames]
    start_mse = _mse(vae, probe)
    start_state = {k: v.clone() for k, v in vae.state_dict().items()}
    opt = ScaledAdam(vae.parameters(), settings.lr)
    gen = torch.Generator().manual_seed(settings.seed)
    _, _, t, h, w = x.shape
    s = settings
    vae.train()
    losses = []
    for step in range(s.steps):
        lr_factor = 0.5 * (1 + math.cos(math.pi * step / s.steps)) * min(1.0, (step + 1) / s.warmup)
        pick = torch.multinomial(torch.as_tensor(weights), s.batch, replacement=True, generator=gen)
        tt = torch.randint(0, t - s.frames + 1, (s.batch,), generator=gen)
        yy = torch.randint(0, h - s.crop + 1, (s.batch,), generator=gen)
        xx = torch.randint(0, w - s.crop + 1, (s.batch,), generator=gen)
        crops = torch.stack(
            [
                x[pick[b], :, tt[b] : tt[b] + s.frames, yy[b] : yy[b] + s.crop, xx[b] : xx[b] + s.crop]
                for b in range(s.batch)
            ]
        )
        loss = F.mse_loss(vae.decode(vae.encode(crops).latent_dist.mode()).sample, crops)
        opt.zero_grad()
        loss.backward()
        opt.step(lr_factor)
        losses.append(float(loss.detach()))
        if (step + 1) % 50 == 0:
            logger.info("VAE fit: step %d/%d, %.1f s", step + 1, s.steps, time.perf_counter() - started)
        if on_step is not None:
            on_step(step + 1, vae)
    skip_branches(blocks, False)
    for p in vae.parameters():
        p.requires_grad_(True)
    vae.eval()
    end_mse = _mse(vae, probe)
    if end_mse > start_mse:  # the fine-tune made it worse (it can diverge on tiny data): keep the closed form
        logger.warning(
            "VAE fit: fine-tuning raised the error (%.5f -> %.5f): the closed-form start is kept", start_mse, end_mse
        )
        vae.load_state_dict(start_state)
    tail = losses[-max(1, len(losses) // 10) :]
    crop_psnr = 10 * math.log10(4 / (sum(tail) / len(tail))) if tail else None
    return FitResult(s.steps, time.perf_counter() - started, init_seconds, crop_psnr)
