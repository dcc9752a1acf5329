"""The conflict gate: OUT holds another cache or foreign files. Decide, then hand back the plan to run."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.settings import get_current_settings

from flows.approval import ConflictAnswer, decide
from infra import outdir
from infra.config import CacheSpec
from infra.errors import ConflictError
from infra.gates.conflicts import (
    ConflictChoice,
    Held,
    flag,
    held,
    next_free_dir,
    overwrite_token,
    same_change,
    same_model,
    settings_that_differ,
)
from infra.gates.decision import Decision
from infra.gates.verify import WRITABLE, VerifyReport, difference_rows
from infra.plan import BuildPlan, adopt_existing_spec
from tasks.plan import plan_build

__all__ = ["WRITABLE", "ConflictAborted", "aborted", "resolve_conflict"]

#: The unowned files a decision's record names (the run report, the card); their count beside.
MAX_NAMED = 100


class ConflictAborted(ConflictError):
    """The run stopped at the conflict gate; nothing was written."""


def default_policy() -> str:
    """ask whenever there is an API (a terminal run always has one: the user's server, whose UI or another process
    answers, or its embedded one, where `flows.approval.decide` asks the terminal or aborts), else abort."""
    return "ask" if get_current_settings().api.url else "abort"


def resolve_conflict(plan: BuildPlan, report: VerifyReport) -> tuple[BuildPlan, Decision | None]:
    """The plan to run — unchanged, adopted (reuse), moved (new_dir) or allowed to replace (overwrite) — and the
    recorded decision (None when OUT was writable and nothing had to be decided)."""
    if report.writable and report.overwrite:
        return _resumed_overwrite(plan, report)
    if report.writable:
        return plan, None
    now = held(plan.out)  # what OUT holds as the person is shown it: what an overwrite's approval covers
    token = overwrite_token(plan.out, report.existing_fingerprint, plan.fingerprint, now)
    decision = _decide(plan, report, token, now)
    get_run_logger().warning("conflict at %s (%s): %s", plan.out, report.kind, decision.text())
    create_markdown_artifact(
        f"## Conflict at `{plan.out}`: **{decision.choice}**\n\n{decision.text()}\n\n{report.markdown()}",
        key="conflict-decision",
        description=f"{report.kind}: {decision.choice}",
    )
    choice = ConflictChoice(decision.choice)
    if choice is ConflictChoice.abort:
        raise aborted(plan, report, token, f"decided: {decision.text()}")
    spool = Path(f"{plan.listing}.{choice.value}") if plan.listing else None  # the new plan's listing, beside
    if choice is ConflictChoice.new_dir:
        return plan_build(plan.config.model_copy(update={"out": str(next_free_dir(plan.out))}), spool), decision
    unowned = frozenset(report.unowned)  # what the preview listed: the decision covers those, no other
    if choice is ConflictChoice.reuse:
        if report.kind == "incompatible":
            adopted = plan_build(adopt_existing_spec(plan.config, plan.spec, plan.out), spool)
            return adopted.decided(keep_unowned=unowned), decision
        if report.kind in WRITABLE:  # this cache, with files no row owns: kept, as the person saw them
            resumed = {"replace_from": report.overwrite["from"]} if report.overwrite else {}
            return plan.decided(keep_unowned=unowned, **resumed), decision
        raise aborted(plan, report, token, f"decided: {decision.text()}, but reuse needs a latentforge cache")
    replaced = (report.overwrite or {}).get("from") or report.existing_fingerprint or "foreign"
    return plan.decided(replace_from=replaced, remove_unowned=unowned), decision


def aborted(plan: BuildPlan, report: VerifyReport, token: str, decided: str) -> ConflictAborted:
    """The conflict gate's error: one line saying what OUT holds and what to add to the same command to go on
    (each answer as it is typed); the detail after it: what differs, field by field, and who decided."""
    what = {"foreign": "holds files latentforge did not write", "damaged": "holds a damaged cache"}
    said = what.get(report.kind, "holds another cache")
    if report.kind in WRITABLE:
        said = f"holds this cache and {_unowned(plan, report)}"
    elif report.unowned:
        said += f" and {_unowned(plan, report)}"
    if report.kind == "damaged" and report.problems:
        said += f" ({len(report.problems)} problem(s), first: {report.problems[0]})"
    elif report.kind == "damaged":  # its cache.json does not read back: the line that names it
        said += f" ({report.message})"
    answers = [
        f"--approve-overwrite {token} to replace it sample by sample",
        f"--on-conflict new_dir to write {next_free_dir(plan.out)} instead",
    ]
    existing = _spec(report)
    if report.kind == "incompatible" and existing is not None:
        differ = settings_that_differ(existing, plan.spec)
        changes = "; ".join(f"{name} {old} → {new}" for name, (old, new) in differ.items()) or "another model"
        said += f" ({changes}; {report.done} sample(s) done)"
        if same_model(existing, plan.spec):
            without = f" without {', '.join(map(flag, differ))}" if differ else ""
            answers.append(f"--on-conflict reuse{without} to resume it with its own settings")
    if report.kind in WRITABLE:
        answers[0] = f"--approve-overwrite {token} to remove them and resume"
        answers.append("--on-conflict reuse to keep them and resume")
    listed = ", ".join(answers[:-1]) + f", or {answers[-1]}"
    headline = f"{plan.out} {said}, so nothing was written; to go on, add to the same command {listed}"
    rows = [f"  {label}: {value}" for label, value in difference_rows(report.differences)]
    detail = [decided, *(["what differs (existing → planned):", *rows] if rows else [])]
    detail += [f"  {problem}" for problem in report.problems[1:6]]
    detail.append(f"`latentforge verify {plan.out}` with this command's settings shows what is there in full")
    return ConflictAborted(headline, detail="\n".join(detail))


def _unowned(plan: BuildPlan, report: VerifyReport) -> str:
    """The unowned files, for the one line: how many, and the first."""
    first = outdir.shown(plan.out, report.unowned[0])
    return f"{len(report.unowned)} file(s) its consumer would load that no ledger row owns (first: {first})"


def _spec(report: VerifyReport) -> CacheSpec | None:
    try:
        return CacheSpec.model_validate(report.existing_spec) if report.existing_spec else None
    except ValueError:
        return None


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
    return plan.decided(replace_from=replaced), decision


def _decide(plan: BuildPlan, report: VerifyReport, token: str, now: Held) -> Decision:
    config = plan.config
    details = {
        "out": str(plan.out),
        "state": report.kind,
        "existing": report.existing_fingerprint,
        "planned": plan.fingerprint,
        **({"unowned": report.unowned[:MAX_NAMED], "unowned_count": len(report.unowned)} if report.unowned else {}),
    }
    if config.gates.approve_overwrite is not None:
        if same_change(config.gates.approve_overwrite, token):
            raise ConflictAborted(
                f"--approve-overwrite {config.gates.approve_overwrite} was printed for what {plan.out} held then, and "
                f"its files changed since (it holds {now.text()} now): nothing was replaced. A token approves what OUT "
                f"held when it was printed; `latentforge verify {plan.out}` shows what it holds now, and "
                f"--approve-overwrite {token} approves this change of it"
            )
        if config.gates.approve_overwrite != token:
            raise ConflictAborted(
                f"--approve-overwrite {config.gates.approve_overwrite} does not match this change of {plan.out} "
                f"({(report.existing_fingerprint or 'foreign')[:16]}… → {plan.fingerprint[:16]}…): a token approves "
                f"one path and one change only; `latentforge verify {plan.out}` with this command's settings prints "
                "the one for this change"
            )
        return Decision(gate="conflict", choice="overwrite", how="token", by="--approve-overwrite", details=details)
    policy = config.gates.on_conflict or default_policy()
    if policy == "ask":
        preview = report.markdown() + _choices_markdown(plan, token)
        timeout, unattended = (
            config.gates.approval_timeout,
            f"--approve-overwrite {token}, --on-conflict new_dir or --on-conflict reuse",
        )
        decision = decide(
            "conflict", ConflictAnswer, ConflictChoice, preview, timeout, unattended=unattended, **details
        )
        if decision.choice == ConflictChoice.overwrite and (later := held(plan.out)) != now:
            raise ConflictAborted(
                f"{plan.out} changed while the question was open (it held {now.text()} when its preview was shown, "
                f"{later.text()} now): nothing was replaced; run the same command again to be shown what it holds now"
            )
        return decision
    return Decision(gate="conflict", choice=policy, how="policy", by=f"on_conflict={policy}", details=details)


def _choices_markdown(plan: BuildPlan, token: str) -> str:
    return (
        "\n\n### Choices\n"
        f"* **reuse** — keep this cache and its settings, resume it (same model only); files no ledger row owns are "
        "kept as listed\n"
        f"* **new_dir** — write to `{next_free_dir(plan.out)}` instead\n"
        "* **overwrite** — replace sample files one by one as new ones are written; nothing is deleted up "
        "front but the files no ledger row owns, as listed; the old cache.json is kept beside. For unattended runs: "
        f"`--approve-overwrite {token}`\n"
        "* **abort** — stop; also what a timeout means\n"
    )
