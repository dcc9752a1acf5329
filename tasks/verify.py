"""Task: what does OUT hold, compared with the plan? Reads only (JSON and weights_only loads)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.gates.plan import BuildPlan
from infra.gates.verify import VerifyReport, verify_out


@task(name="verify-existing", cache_policy=NO_CACHE)
def verify_existing(plan: BuildPlan) -> VerifyReport:
    """Classify OUT (absent, compatible, incompatible, foreign, damaged) with what differs and one sample checked."""
    return verify_out(plan.out, plan.spec, latent_shape=plan.latent_shape, text_shape=plan.text_shape)
