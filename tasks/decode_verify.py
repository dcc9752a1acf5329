"""Task: decode stored latents back to pixels and measure them against the re-derived source frames."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.audit.decode_verify import DecodeReport, decode_and_verify
from infra.plan import BuildPlan
from infra.preprocess.encode import load_options


@task(name="decode-and-verify", cache_policy=NO_CACHE)
def decode_verify(plan: BuildPlan) -> DecodeReport:
    """K samples spread over groups: PSNR, SSIM, side-by-side mp4 and PNG strips under OUT/reports/decode/."""
    gates = plan.config.gates  # the flow's settings: the decode step's own part
    return decode_and_verify(
        plan.out,
        model_dir=plan.job.model_dir,
        n=gates.decode_samples,
        device=plan.job.device,
        dtype=plan.spec.dtype,
        min_psnr=gates.min_psnr,
        options=load_options(plan.job),
    )
