"""Running the tiny AutoencoderKLWan stage by stage, chunk by chunk, exactly as `_encode` / `_decode` run it.

The closed-form initialisation fits one layer at a time, so it needs the inputs each layer sees in the real
chunked run (the first frame alone, then chunks of four frames / one latent frame, with the causal caches).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanResidualBlock, patchify

CACHE_T = 2  # frames a causal conv keeps from the previous chunk (diffusers' CACHE_T)
Stage = Callable[..., torch.Tensor]


def _shortcut_only(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 - mirrors the diffusers signature
    if feat_cache is not None:
        feat_idx[0] += 2  # conv1 and conv2's cache slots, as the full block uses them
    return self.conv_shortcut(x)


def zero_branches(vae: AutoencoderKLWan) -> list[WanResidualBlock]:
    """Zero every residual branch's last conv and every attention output projection; returns the residual
    blocks. What is left is the network's linear path (shortcuts, resamplers, time convs, norms + SiLU heads)."""
    blocks = []
    for m in vae.modules():
        if isinstance(m, WanResidualBlock):
            torch.nn.init.zeros_(m.conv2.weight)
            torch.nn.init.zeros_(m.conv2.bias)
            blocks.append(m)
        elif isinstance(m, WanAttentionBlock):
            torch.nn.init.zeros_(m.proj.weight)
            torch.nn.init.zeros_(m.proj.bias)
    return blocks


def skip_branches(blocks: list[WanResidualBlock], on: bool = True) -> None:
    """While on, a residual block computes only its shortcut: exactly its output when conv2 is zero, faster."""
    for m in blocks:
        if on:
            m.forward = _shortcut_only.__get__(m)
        elif "forward" in m.__dict__:
            del m.forward


def _cached_conv(conv, x, cache, idx):
    """conv_in / conv_out of WanEncoder3d / WanDecoder3d with their feature-cache handling."""
    i = idx[0]
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and cache[i] is not None:
        cache_x = torch.cat([cache[i][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    out = conv(x, cache[i])
    cache[i] = cache_x
    idx[0] += 1
    return out


def run_stage(fn: Stage, chunks: list[torch.Tensor], decoder: bool = False) -> list[torch.Tensor]:
    """One stage over all chunks with a fresh cache (decoder stages also get `first_chunk`)."""
    cache: list = [None] * 64
    outs = []
    for i, c in enumerate(chunks):
        idx = [0]
        outs.append(fn(c, cache, idx, i == 0) if decoder else fn(c, cache, idx))
    return outs


def enc_stages(vae: AutoencoderKLWan) -> list[Stage]:
    """conv_in, each down block, then mid block + norm + conv_out."""
    e = vae.encoder
    stages: list[Stage] = [lambda x, c, i: _cached_conv(e.conv_in, x, c, i)]
    for blk in e.down_blocks:
        stages.append(lambda x, c, i, blk=blk: blk(x, feat_cache=c, feat_idx=i))

    def tail(x, c, i):
        x = e.mid_block(x, feat_cache=c, feat_idx=i)
        return _cached_conv(e.conv_out, e.nonlinearity(e.norm_out(x)), c, i)

    stages.append(tail)
    return stages


def dec_stages(vae: AutoencoderKLWan) -> list[Stage]:
    """conv_in + mid block, each up block, then norm + conv_out."""
    d = vae.decoder
    stages: list[Stage] = [lambda x, c, i, f: d.mid_block(_cached_conv(d.conv_in, x, c, i), feat_cache=c, feat_idx=i)]
    for blk in d.up_blocks:
        stages.append(lambda x, c, i, f, blk=blk: blk(x, feat_cache=c, feat_idx=i, first_chunk=f))
    stages.append(lambda x, c, i, f: _cached_conv(d.conv_out, d.nonlinearity(d.norm_out(x)), c, i))
    return stages


def pixel_chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """Pixels (B, 3, T, H, W) patchified (2x2) and split as `_encode` splits them: frame 0, then fours."""
    p = patchify(x, 2)
    return [p[:, :, :1]] + [p[:, :, 1 + 4 * k : 5 + 4 * k] for k in range((p.shape[2] - 1) // 4)]


def cat(chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(chunks, 2)


class Capture:
    """Inputs (and outputs) of one module over a chunked run, in call order."""

    def __init__(self, module: torch.nn.Module, outputs: bool = False) -> None:
        self.inputs: list[tuple] = []
        self.outputs: list[torch.Tensor] = []
        self.hooks = [module.register_forward_pre_hook(lambda m, a: self.inputs.append(a))]
        if outputs:
            self.hooks.append(module.register_forward_hook(lambda m, a, o: self.outputs.append(o)))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def causal_padded(conv, args: tuple) -> torch.Tensor:
    """The tensor WanCausalConv3d.forward actually convolves (cache prepended, causal zero padding)."""
    x = args[0]
    cache_x = args[1] if len(args) > 1 else None
    padding = list(conv._padding)
    if cache_x is not None and conv._padding[4] > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        padding[4] -= cache_x.shape[2]
    return F.pad(x, padding)


def time_windows(xp: torch.Tensor, kt: int, st: int) -> torch.Tensor:
    """(B, C, T', H, W) padded -> (B, C, kt, T_out, H, W): the kt taps of each output frame, like the weight."""
    t_out = (xp.shape[2] - kt) // st + 1
    return torch.stack([xp[:, :, k : k + st * (t_out - 1) + 1 : st] for k in range(kt)], 2)


def block2x2(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> rows (N*H/2*W/2, C*4) in (c, ky, kx) order."""
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, c * 4)
