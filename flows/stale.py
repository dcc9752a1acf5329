"""The stale gate: done samples whose source changed since they were encoded (verify-existing lists them) are
never reused silently. A person (or ``--on-stale``) decides: replace exactly those, keep them (recorded), abort.
"""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.approval import StaleAnswer, StaleChoice, decide
from flows.conflict import default_policy
from infra.errors import GateFailed
from infra.gates.decision import Decision
from infra.gates.verify import VerifyReport
from infra.plan import BuildPlan

POLICY_CHOICE = {"replace": StaleChoice.replace_stale, "keep": StaleChoice.keep, "abort": StaleChoice.abort}
LISTED = 50


class StaleAborted(GateFailed):
    """Samples changed in the source and nobody chose to replace or keep them."""


def resolve_stale(plan: BuildPlan, report: VerifyReport) -> tuple[BuildPlan, Decision | None]:
    """The plan to run (with the stale samples to replace or keep) and the decision; None when none is stale."""
    if not report.stale:
        return plan, None
    selectors = [s["selector"] for s in report.stale]
    details = {"count": len(selectors), "samples": selectors}
    policy = plan.config.gates.on_stale or default_policy()
    if policy == "ask":
        timeout, unattended = plan.config.gates.approval_timeout, "--on-stale replace or --on-stale keep"
        decision = decide("stale", StaleAnswer, StaleChoice, preview(report), timeout, unattended=unattended, **details)
    else:
        choice = POLICY_CHOICE[policy].value
        decision = Decision(gate="stale", choice=choice, how="policy", by=f"on_stale={policy}", details=details)
    get_run_logger().warning("%d stale sample(s) in %s: %s", len(selectors), plan.out, decision.text())
    create_markdown_artifact(f"{preview(report)}\n**decision**: {decision.text()}\n", key="stale-decision")
    choice = StaleChoice(decision.choice)
    if choice is StaleChoice.abort:
        raise StaleAborted(
            f"{len(selectors)} done sample(s) of {plan.out} changed in the source since they were encoded "
            f"({', '.join(selectors[:5])}{', ...' if len(selectors) > 5 else ''}), so nothing was written; to go on, "
            "add to the same command --on-stale replace to encode exactly those again, or --on-stale keep to keep "
            "them as they are (recorded)",
            detail=f"decided: {decision.text()}",
        )
    field = "stale_replace" if choice is StaleChoice.replace_stale else "stale_keep"
    return plan.decided(**{field: frozenset(selectors)}), decision


def preview(report: VerifyReport) -> str:
    """What changed, per sample, and what each choice does."""
    lines = [f"## Stale samples: {len(report.stale)} changed in the source since they were encoded", ""]
    lines += ["| sample | what changed |", "|---|---|"]
    for sample in report.stale[:LISTED]:
        changed = ", ".join(f"{k}: {v}" for k, v in sample["changed"].items())
        lines.append(f"| {sample['group']}/{sample['id']} | {changed} |")
    if len(report.stale) > LISTED:
        lines.append(f"| … {len(report.stale) - LISTED} more | |")
    lines += [
        "",
        "### Choices",
        "* **replace_stale** — re-encode exactly these samples from the source as it is now; their files are "
        "replaced, every other file stays as it is",
        "* **keep** — keep their outputs as they are; the run report records that the cache holds them knowingly",
        "* **abort** — stop, nothing written; also what a timeout means",
    ]
    return "\n".join(lines) + "\n"
