"""Seed 000's recipe as a plain loop, on any device and dtype: what the build's ``x0`` and ``text_embeds`` must equal.

It shares no code with the pipeline and follows the published steps literally (as tests/test_fidelity.py's
reference does on the CPU): decode every frame with PyAV → ``np.linspace(0, T-1, F).round()`` → ``/127.5 - 1`` →
bilinear, ``align_corners=False`` → ``AutoencoderKLWan`` ``latent_dist.mode()`` → ``(z - mean) / std`` in float32 →
bf16; UMT5 padded to 512, ``last_hidden_state`` as is (pad rows included) → bf16. One clip and one prompt a call
(batch 1), the models in `dtype` on `device`.

    python bench/gpu/plain.py --model DIR --clip a.mp4 --prompt "..." --device cpu --dtype fp32 --out ref.pt
"""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
from diffusers import AutoencoderKLWan
from transformers import AutoTokenizer, UMT5EncoderModel

MAX_LENGTH = 512
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class PlainLoop:
    """The recipe's two models, loaded once, on `device` in `dtype`."""

    model: Path
    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self.vae = AutoencoderKLWan.from_pretrained(self.model / "vae", torch_dtype=self.dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model / "tokenizer")
        path = self.model / "text_encoder"
        self.text = UMT5EncoderModel.from_pretrained(path, torch_dtype=self.dtype).to(self.device).eval()
        channels = self.vae.config.z_dim
        self.mean = torch.tensor(self.vae.config.latents_mean).view(1, channels, 1, 1, 1)
        self.std = torch.tensor(self.vae.config.latents_std).view(1, channels, 1, 1, 1)

    @torch.no_grad()
    def x0(self, video: bytes, frames: int, height: int, width: int) -> torch.Tensor:
        container = av.open(io.BytesIO(video))
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        container.close()
        idx = np.linspace(0, len(decoded) - 1, frames).round().astype(int)
        x = torch.from_numpy(np.stack([decoded[i] for i in idx])).float() / 127.5 - 1
        x = torch.nn.functional.interpolate(x.permute(0, 3, 1, 2), size=(height, width), mode="bilinear",
                                            align_corners=False)  # fmt: skip
        x = x.permute(1, 0, 2, 3).unsqueeze(0)
        z = self.vae.encode(x.to(self.device, self.dtype)).latent_dist.mode().float().cpu()
        return ((z - self.mean) / self.std).to(torch.bfloat16)[0]

    @torch.no_grad()
    def text_embeds(self, prompt: str) -> torch.Tensor:
        tokens = self.tokenizer(prompt, padding="max_length", max_length=MAX_LENGTH, truncation=True,
                                add_special_tokens=True, return_tensors="pt")  # fmt: skip
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        return self.text(ids, mask).last_hidden_state[0].float().cpu().to(torch.bfloat16)


def bf16_steps(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max, mean) of |got - ref| in units of one bf16 step (the spacing of bf16 numbers at `ref`'s magnitude)."""
    ref32, got32 = ref.float(), got.float()
    _, exponent = torch.frexp(ref32.abs().clamp_min(2.0**-126))
    step = torch.ldexp(torch.ones_like(ref32), exponent - 8)  # bf16: 8 significant bits
    steps = (got32 - ref32).abs() / step
    return float(steps.max()), float(steps.mean())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--clip", type=Path, required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--geometry", type=int, nargs=3, default=[33, 832, 832], metavar=("F", "H", "W"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, required=True, help="where {x0, text_embeds} are saved")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loop = PlainLoop(args.model, torch.device(args.device), DTYPES[args.dtype])
    x0 = loop.x0(args.clip.read_bytes(), *args.geometry)
    torch.save({"x0": x0, "text_embeds": loop.text_embeds(args.prompt)}, args.out)


if __name__ == "__main__":
    main()
