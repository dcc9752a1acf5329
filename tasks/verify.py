"""Task: what does OUT hold, and may this run write there?"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.cachedir import OutState, classify
from infra.errors import ConflictError
from infra.plan import BuildPlan


@task(name="verify-existing", cache_policy=NO_CACHE)
def verify_existing(plan: BuildPlan) -> OutState:
    """Classify OUT. Anything but absent or compatible stops the run (on_conflict=abort)."""
    state = classify(plan.out, plan.spec)
    if state.kind not in ("absent", "compatible"):
        lines = [f"{state.kind}: {state.message}"]
        lines += [f"  {k}: existing {v['existing']!r} → planned {v['planned']!r}" for k, v in state.differences.items()]
        lines.append(f"on_conflict={plan.config.on_conflict}: nothing was written to {plan.out}")
        raise ConflictError("\n".join(lines))
    return state
