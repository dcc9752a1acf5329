"""Task: the audio gate — every done sample of an audio run checked for a loadable, non-empty audio latent."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.audit.audio_gate import AudioReport, audio_check
from infra.plan import BuildPlan


@task(name="audio-gate", cache_policy=NO_CACHE)
def audio_gate(plan: BuildPlan) -> AudioReport:
    """Audio latents present, the clips without one and why; "not an audio run" for a video-only spec."""
    return audio_check(plan.out)
