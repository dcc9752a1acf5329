"""The conflict gate: OUT holds another cache or foreign files. Decide, then hand back the plan to run."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.settings import get_current_settings

from flows.approval import ConflictAnswer, decide
from infra.errors import ConflictError
from infra.gates.conflicts import ConflictChoice, adopt_existing_spec, next_free_dir, overwrite_token
from infra.gates.decision import Decision
from infra.gates.verify import VerifyReport
from infra.plan import BuildPlan
from tasks.plan import plan_build

WRITABLE = ("absent", "compatible")


class ConflictAborted(ConflictError):
    """The run stopped at the conflict gate; nothing was written."""


def default_policy() -> str:
    """ask whenever there is an API (a terminal run always has one: the user's server, whose UI or another process
    answers, or its embedded one, where `flows.approval.decide` asks the terminal or aborts), else abort."""
    return "ask" if get_current_settings().api.url else "abort"


def resolve_conflict(plan: BuildPlan, report: VerifyReport) -> tuple[BuildPlan, Decision | None]:
    """The plan to run — unchanged, adopted (reuse), moved (new_dir) or allowed to replace (overwrite) — and the
    recorded decision (None when OUT was writable and nothing had to be decided)."""
    if report.kind in WRITABLE and report.overwrite:
        return _resumed_overwrite(plan, report)
    if report.kind in WRITABLE:
        return plan, None
    token = overwrite_token(plan.out, report.existing_fingerprint, plan.fingerprint)
    decision = _decide(plan, report, token)
    get_run_logger().warning("conflict at %s (%s): %s", plan.out, report.kind, decision.text())
    create_markdown_artifact(
        f"## Conflict at `{plan.out}`: **{decision.choice}**\n\n{decision.text()}\n\n{report.markdown()}",
        key="conflict-decision",
        description=f"{report.kind}: {decision.choice}",
    )
    choice = ConflictChoice(decision.choice)
    if choice is ConflictChoice.abort:
        raise ConflictAborted(f"{report.text()}\ndecision: {decision.text()}; nothing was written to {plan.out}")
    spool = Path(f"{plan.listing}.{choice.value}") if plan.listing else None  # the new plan's listing, beside
    if choice is ConflictChoice.new_dir:
        return plan_build(plan.config.model_copy(update={"out": str(next_free_dir(plan.out))}), spool), decision
    if choice is ConflictChoice.reuse:
        if report.kind != "incompatible":
            raise ConflictAborted(f"reuse needs a latentforge cache in {plan.out}; it is {report.kind}")
        return plan_build(adopt_existing_spec(plan.config, plan.spec, plan.out), spool), decision
    return plan.model_copy(update={"replace_from": report.existing_fingerprint or "foreign"}), decision


def _resumed_overwrite(plan: BuildPlan, report: VerifyReport) -> tuple[BuildPlan, Decision]:
    """OUT holds this spec's cache.json over an approved overwrite that an interrupted run began: this change, in
    progress. Its approval is on record in OUT (cache.json names what it replaces; the old one is kept beside), so
    the run goes on replacing the old spec's samples, and records that it did."""
    replaced, pending = report.overwrite["from"], report.overwrite["pending"]
    details = {"out": str(plan.out), "state": "overwrite in progress", "existing": replaced, "pending": pending}
    decision = Decision(
        gate="conflict",
        choice="overwrite",
        how="resumed",
        by=f"the overwrite of {replaced[:16]}… approved for an earlier, interrupted run (cache.json records it)",
        details={**details, "planned": plan.fingerprint},
    )
    get_run_logger().warning("%s: resuming the approved overwrite, %d sample(s) still to replace", plan.out, pending)
    return plan.model_copy(update={"replace_from": replaced}), decision


def _decide(plan: BuildPlan, report: VerifyReport, token: str) -> Decision:
    config = plan.config
    details = {
        "out": str(plan.out),
        "state": report.kind,
        "existing": report.existing_fingerprint,
        "planned": plan.fingerprint,
    }
    if config.gates.approve_overwrite is not None:
        if config.gates.approve_overwrite != token:
            raise ConflictAborted(
                f"--approve-overwrite does not match {plan.out} and its change "
                f"{(report.existing_fingerprint or 'foreign')[:16]} → {plan.fingerprint[:16]} "
                "(a token approves one path and one change only; `latentforge verify` prints the current one)"
            )
        return Decision(gate="conflict", choice="overwrite", how="token", by="--approve-overwrite", details=details)
    policy = config.gates.on_conflict or default_policy()
    if policy == "ask":
        preview = report.markdown() + _choices_markdown(plan, token)
        timeout, unattended = (
            config.gates.approval_timeout,
            f"--on-conflict reuse|new_dir, or --approve-overwrite {token}",
        )
        return decide("conflict", ConflictAnswer, ConflictChoice, preview, timeout, unattended=unattended, **details)
    return Decision(gate="conflict", choice=policy, how="policy", by=f"on_conflict={policy}", details=details)


def _choices_markdown(plan: BuildPlan, token: str) -> str:
    return (
        "\n\n### Choices\n"
        f"* **reuse** — keep this cache and its settings, resume it (same model only)\n"
        f"* **new_dir** — write to `{next_free_dir(plan.out)}` instead\n"
        "* **overwrite** — replace sample files one by one as new ones are written; nothing is deleted up "
        f"front; the old cache.json is kept beside. For unattended runs: `--approve-overwrite {token}`\n"
        "* **abort** — stop; also what a timeout means\n"
    )
