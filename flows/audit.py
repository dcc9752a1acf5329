"""After the preprocess: reconcile_counts → [loss approval] → audio_gate → decode_and_verify → the run report.

A shortfall is a hard stop: the run pauses for accept_loss / abort (or follows on_loss). Whatever
happens, the run report is written, one per run, before the run ends.
"""

from __future__ import annotations

import math
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run

from flows.approval import LossAnswer, LossChoice, decide
from flows.conflict import default_policy
from flows.steps import set_step
from infra.audit.audio_gate import AudioReport
from infra.audit.decode_verify import DecodeReport
from infra.audit.reconcile import ReconcileReport
from infra.audit.run_report import HIDDEN_SETTINGS, run_report, write_run_report
from infra.errors import ConfigError, GateFailed
from infra.gates.conflicts import overwrite_token
from infra.gates.decision import Decision
from infra.plan import BuildPlan, make_spec
from infra.preprocess.inflight import KILLED_RUN
from tasks.audio_gate import audio_gate
from tasks.decode_verify import decode_verify
from tasks.reconcile import reconcile_counts

#: Missing samples the reconciliation artifact lists (the reconcile report in OUT lists every one).
MISSING_LISTED = 50


class LossAborted(GateFailed):
    """Samples are missing and nobody accepted the loss."""


class DecodeGateFailed(GateFailed):
    """A decoded sample fell below --min-psnr."""


class AudioGateFailed(GateFailed):
    """An audio run holds no audio latent at all (or unreadable ones): never passed, whatever --on-loss says."""


def audit(
    plan: BuildPlan, summary: dict[str, Any], timings: dict[str, float], decisions: list[Decision]
) -> dict[str, Any]:
    """Reconcile, gate on loss, decode and verify, write the run report (with `decisions`, those made before,
    and the ones made here); raise after writing it if a gate failed."""
    logger = get_run_logger()
    set_step("reconcile-counts")
    recon = reconcile_counts(plan)
    logger.info("%s", recon.text())
    create_table_artifact(recon.table(), key="reconciliation", description=f"expected vs produced in {plan.out}")
    if not recon.ok:  # which samples are missing, and why (capped; the reconcile report lists them all)
        create_markdown_artifact(
            recon.missing_markdown(limit=MISSING_LISTED),
            key="reconciliation-missing",
            description=f"{recon.shortfall} sample(s) missing from {plan.out}",
        )
    decisions = list(decisions)
    failure: Exception | None = None
    if not recon.ok:
        set_step("loss-gate")
        loss = _loss_decision(plan, recon)
        decisions.append(loss)
        logger.warning("%d sample(s) missing: %s", recon.shortfall, loss.text())
        create_markdown_artifact(
            f"## Loss at `{plan.out}`: **{loss.choice}**\n\n{loss.text()}\n\n{recon.missing_markdown(limit=20)}",
            key="loss-decision",
            description=f"{recon.shortfall} missing: {loss.choice}",
        )
        if loss.choice == LossChoice.abort:
            failure = LossAborted(
                f"{recon.shortfall} sample(s) missing from {plan.out} {recon.reasons()}; to accept the loss (recorded "
                f"in the run report), add --on-loss accept to the same command; {_to_fill(recon)}",
                detail=f"decided: {loss.text()}",
            )
    audio = None
    if failure is None:
        set_step("audio-gate")
        audio = audio_gate(plan)
        logger.info("%s", audio.text())
        if audio.audio_run:
            create_markdown_artifact(audio.markdown(), key="audio-gate", description=f"audio latents in {plan.out}")
        if not audio.ok:
            failure = _audio_failed(plan, audio)
    decode = None
    if failure is None and plan.config.gates.decode_samples > 0:
        set_step("decode-and-verify")
        decode = decode_verify(plan)
        logger.info("%s", decode.text())
        _publish_decode(decode)
        if not decode.ok:
            failure = _decode_failed(decode)
    report = run_report(
        plan.job,
        plan.shards,
        summary,
        settings=plan.settings_record(HIDDEN_SETTINGS),
        reconciliation=recon.to_dict(),
        decode=decode.to_dict() if decode is not None else None,
        audio=audio.to_dict() if audio is not None else None,
        decisions=decisions,
        timings=timings,
        flow_run_id=str(flow_run.get_id()) if flow_run.get_id() else None,
    )
    path = write_run_report(plan.out, report)
    logger.info("run report: %s", path)
    if failure is not None:
        raise failure
    return {
        "run_report": str(path),
        "reconciled": recon.ok,
        "gone_from_source": len(recon.gone_from_source),  # the summary's samples: those in the source now
        "decisions": [d.model_dump() for d in decisions],
        "decode_headline": decode.headline() if decode is not None else None,
        "decode_strips": [str(p) for p in decode.strip_paths] if decode is not None else [],
    }


def _to_fill(recon: ReconcileReport) -> str:
    """How to fill a shortfall, by its reasons: a ``killed_run`` sample (proven: it took down the process decoding it
    alone, twice; `infra.preprocess.inflight`) is not tried by the same command again, the others are."""
    reasons = recon.reasons()
    killed = reasons.pop(KILLED_RUN, 0)
    ways = ["to fill it, fix what the reasons name and run the same command again"] if reasons else []
    if killed:
        run = flow_run.get_id() or "RUN_ID"
        ways.append(
            f"the {killed} {KILLED_RUN} sample(s) took down, twice, the process that decoded them alone (their rows "
            f"name the signal): the same command does not try them again; to try them again: latentforge rerun {run} "
            "--failed-only"
        )
    return "; ".join(ways)


def _loss_decision(plan: BuildPlan, recon: ReconcileReport) -> Decision:
    details = {"shortfall": recon.shortfall, "reasons": recon.reasons()}
    policy = plan.config.gates.on_loss or default_policy()
    if policy == "ask":
        timeout, unattended = plan.config.gates.approval_timeout, "--on-loss accept"
        preview = recon.missing_markdown(limit=20)  # three narrow columns: the resume dialog needs no sideways scroll
        return decide("loss", LossAnswer, LossChoice, preview, timeout, unattended=unattended, **details)
    choice = LossChoice.accept_loss if policy == "accept" else LossChoice.abort
    return Decision(gate="loss", choice=choice.value, how="policy", by=f"on_loss={policy}", details=details)


def _audio_failed(plan: BuildPlan, audio: AudioReport) -> AudioGateFailed:
    """The audio gate's error. Silent clips: the same command with ``--skip-audio`` builds them without audio, which is
    another spec in the same OUT, so it needs that change's overwrite token, given here (the spec is worked out as
    the build would: `make_spec`)."""
    if not audio.silent:
        return AudioGateFailed(f"{audio.headline()}: `latentforge audio-check {plan.out}` names them")
    try:
        _, silent, _, _ = make_spec(plan.config.with_values(audio=False))
    except ConfigError:  # a mode that trains on audio
        mode = plan.spec.mode
        return AudioGateFailed(f"{audio.headline(advice=False)}; --mode {mode} trains on audio: it needs clips with it")
    token = overwrite_token(plan.out, plan.fingerprint, silent.fingerprint())
    return AudioGateFailed(
        f"{audio.headline(advice=False)}; silent clips train without audio: to build them so, add --skip-audio "
        f"--approve-overwrite {token} to the same command (its samples are written again without audio)"
    )


def _decode_failed(decode: DecodeReport) -> DecodeGateFailed:
    """The decode gate's error: the verdict, where the strips are, and what accepts these numbers (the cache is
    whole: the same command again encodes nothing and judges them again)."""
    psnrs = [row.psnr for row in decode.rows if math.isfinite(row.psnr)]
    if decode.problems or not psnrs:
        answer = "the problems below say which samples could not be decoded"
    else:
        answer = f"to accept these numbers, add --min-psnr {math.floor(min(psnrs))} to the same command"
    return DecodeGateFailed(
        f"{decode.headline()}: look at the strips in {decode.report_dir}; {answer}", detail=decode.text()
    )


def _publish_decode(decode: DecodeReport) -> None:
    """The numbers as a table, and the report with each strip drawn in it (embedded PNGs: an image artifact's
    ``file://`` URL is not loaded by a browser on the server's ``http://`` page)."""
    create_table_artifact(decode.table(), key="decode-verify", description="PSNR / SSIM of decoded samples")
    description = f"decode-and-verify: strips and PSNR / SSIM (files in {decode.report_dir})"
    create_markdown_artifact(decode.artifact_markdown(), key="decode-verify-report", description=description)
