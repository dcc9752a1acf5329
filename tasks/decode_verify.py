"""Task: decode stored latents back to pixels and measure them against the re-derived source frames."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.audit.decode_verify import DecodeReport, decode_and_verify
from infra.plan import BuildPlan
from infra.preprocess.encode import load_options


@task(name="decode-and-verify", cache_policy=NO_CACHE)
def decode_verify(plan: BuildPlan) -> DecodeReport:
    """K samples spread over groups: PSNR, SSIM, side-by-side mp4 and PNG strips under OUT/reports/decode/."""
    cfg = plan.config
    return decode_and_verify(
        plan.out,
        model_dir=Path(cfg.model).expanduser(),
        n=cfg.gates.decode_samples,
        device=cfg.run.device,
        dtype=cfg.encoding.dtype,
        min_psnr=cfg.gates.min_psnr,
        options=load_options(cfg),
    )
