"""prefect.yaml and infra/deploy/automations.yaml against a real Prefect server.

Valid for Prefect and for each flow; `prefect deploy --all` creates the three deployments (schedule,
concurrency limit, job env); a worker runs a tiny build and the sanity check from their deployments; the
automations file is accepted by `prefect automation create --from-file`, and a SIGKILLed run is marked
Crashed by the heartbeat automation, which the failure automation then reports to a webhook.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import httpx
import pytest
import yaml
from prefect.cli.deploy._models import PrefectYamlModel  # private: prefect is pinned to 3.9.x in tests
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import FlowRunFilter
from prefect.client.schemas.objects import FlowRun
from prefect.flows import load_flow_from_entrypoint
from prefect.settings import PREFECT_API_URL, PREFECT_RUNNER_HEARTBEAT_FREQUENCY, temporary_settings
from typer.testing import CliRunner

from flows.build import build_cache
from flows.cli import app
from flows.sanity import sanity_check
from infra.config import BuildConfig
from infra.ops.automations import render_automations
from infra.ops.server import JOB_ENV
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip
from tests.receiver import Receiver, receiver

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "latentforge"
DEPLOYMENTS = {"build-cache": "build_cache", "nightly-incremental": "build_cache", "sanity": "sanity_check"}
RUN_WAIT = 240
DEPLOY = ROOT / "infra" / "deploy"
AUTOMATIONS = DEPLOY / "automations.yaml"
HEARTBEAT_TEST_WITHIN = 10  # the file says 90 s; Prefect's minimum for a proactive trigger is 10 s


def _prefect_yaml() -> PrefectYamlModel:
    return PrefectYamlModel.model_validate(yaml.safe_load((ROOT / "prefect.yaml").read_text()))


def _by_name() -> dict[str, Any]:
    return {d.name: d for d in _prefect_yaml().deployments}


def test_prefect_yaml_validates_and_parameters_are_valid_for_each_flow():
    deployments = _by_name()
    assert set(deployments) == set(DEPLOYMENTS)
    for name, function in DEPLOYMENTS.items():
        deployment = deployments[name]
        path, _, entry = deployment.entrypoint.partition(":")
        assert (ROOT / path).is_file() and entry == function
        flow = load_flow_from_entrypoint(str(ROOT / deployment.entrypoint))
        validated = flow.validate_parameters(deployment.parameters)  # what the server checks on a run
        assert isinstance(validated["config"], BuildConfig)
        assert deployment.work_pool.name == POOL
        assert deployment.work_pool.job_variables["env"] == JOB_ENV


def test_nightly_schedule_asks_never_overwrites_and_uploads():
    deployments = _by_name()
    nightly = deployments["nightly-incremental"]
    assert len(nightly.schedules) == 1
    schedule = nightly.schedules[0]
    assert (schedule.cron, schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", True)
    assert nightly.concurrency_limit == 1 and deployments["build-cache"].concurrency_limit == 1
    nightly_config = BuildConfig.model_validate(nightly.parameters["config"])
    assert (nightly_config.gates.on_conflict, nightly_config.gates.on_loss) == ("ask", "ask")
    assert nightly_config.gates.approve_overwrite is None and nightly_config.upload is not None
    assert nightly_config.gates.approval_timeout < 24 * 3600  # an unanswered pause ends before the next night
    assert not deployments["build-cache"].schedules and not deployments["sanity"].schedules


def test_the_flow_form_is_the_typed_config():
    schema = build_cache.parameters.model_dump()
    assert schema["required"] == ["config"]
    config_schema = schema["definitions"]["BuildConfig"]
    assert config_schema["additionalProperties"] is False
    assert {"source", "model", "out", "encoding", "gates", "run"} <= set(config_schema["properties"])
    encoding = schema["definitions"]["EncodingConfig"]  # a section: a form of its own inside the config's
    assert encoding["additionalProperties"] is False and {"frames", "height", "width"} <= set(encoding["properties"])
    assert encoding["properties"]["dtype"]["enum"] == ["bf16", "fp32"]


def test_the_sanity_flow_fails_without_a_usable_sample_and_writes_nothing(tiny_model, clips, tmp_path):
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, clips["audio_only"], b"only audio")]})
    with temporary_settings({PREFECT_RUNNER_HEARTBEAT_FREQUENCY: None}):
        state = sanity_check(config(src, tiny_model, tmp_path / "out"), return_state=True)
    assert state.is_failed() and "no usable sample" in state.message
    assert not (tmp_path / "out").exists()


def test_service_files_agree_with_the_pool_and_heartbeat():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    worker = compose["services"]["worker"]
    assert {k: worker["environment"][k] for k in JOB_ENV} == JOB_ENV
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert f"--pool {POOL}" in " ".join(worker["command"])
    unit = (DEPLOY / "systemd" / "latentforge-worker.service").read_text()
    assert f"--pool {POOL}" in unit and all(f"Environment={k}={v}" in unit for k, v in JOB_ENV.items())
    assert "prefect server start" in (DEPLOY / "systemd" / "prefect-server.service").read_text()


# --- against a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(prefect_server: dict[str, str]) -> Iterator[SyncPrefectClient]:
    """A client of the real server (it keeps the URL it was made with; the harness stays the default)."""
    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        made = get_client(sync_client=True)
    with made:
        yield made


@pytest.fixture(scope="module")
def deployed(prefect_server: dict[str, str]) -> dict[str, str]:
    """`prefect work-pool create` + `prefect --no-prompt deploy --all` from the repository root."""
    pool = subprocess.run(
        [PREFECT, "work-pool", "create", POOL, "--type", "process"], env=prefect_server, capture_output=True, text=True
    )
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deploy = subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--all"], cwd=ROOT, env=prefect_server, capture_output=True, text=True
    )
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    return prefect_server


def test_deploy_all_creates_the_deployments_schedule_and_limits(deployed, client):
    flows = {"build-cache": "build-cache", "nightly-incremental": "build-cache", "sanity": "sanity-check"}
    found = {name: client.read_deployment_by_name(f"{flow}/{name}") for name, flow in flows.items()}
    nightly = found["nightly-incremental"]
    assert len(nightly.schedules) == 1 and nightly.schedules[0].active
    assert (nightly.schedules[0].schedule.cron, nightly.schedules[0].schedule.timezone) == ("0 2 * * *", "UTC")
    # 3.9 keeps a deployment's concurrency limit as a global limit named deployment:<id>
    assert nightly.global_concurrency_limit.limit == 1
    assert found["build-cache"].global_concurrency_limit.limit == 1
    stored = nightly.parameters["config"]["gates"]
    assert (stored["on_conflict"], stored["on_loss"]) == ("ask", "ask") and "approve_overwrite" not in stored
    assert all(d.work_pool_name == POOL and d.job_variables == {"env": JOB_ENV} for d in found.values())
    assert not found["build-cache"].schedules and not found["sanity"].schedules


def _wait_final(client: SyncPrefectClient, run_id: UUID, worker: subprocess.Popen) -> FlowRun:
    deadline = time.monotonic() + RUN_WAIT
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            return run
        assert worker.poll() is None, f"worker exited with {worker.returncode} before run {run_id} ended"
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} not finished within {RUN_WAIT} s")


#: Seconds a stopping worker gets after SIGTERM before its process group is killed.
WORKER_STOP_WAIT = 5


@contextlib.contextmanager
def _worker(env: dict[str, str], name: str, log_path: Path) -> Iterator[subprocess.Popen]:
    """`prefect worker start` on the pool from the repository root; stopped by its process group."""
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", POOL, "--name", name],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            yield worker
        finally:
            _stop(worker)


def _stop(worker: subprocess.Popen) -> None:
    """SIGTERM the worker's process group; SIGKILL what is left after WORKER_STOP_WAIT s. What this file tests is
    what the worker ran, not how fast it stops: on this 2-core machine `prefect worker start` has taken over 30 s to
    stop after its runs ended, and the test must not fail (nor wait) on that: its runs are final before it stops."""
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=WORKER_STOP_WAIT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)


def test_a_worker_runs_the_build_and_the_sanity_deployments(deployed, client, tiny_model, clips, tmp_path):
    videos = [cut_clip(clips["carphone"], 9), cut_clip(clips["bikes"], 9, width=160)]
    src = make_shards(tmp_path / "src", {"s": [sample(0, i, v, f"clip {i}".encode()) for i, v in enumerate(videos)]})
    build_out, sanity_out = tmp_path / "cache", tmp_path / "checked"
    runs = {}
    for name, flow, out in (("build-cache", "build-cache", build_out), ("sanity", "sanity-check", sanity_out)):
        deployment = client.read_deployment_by_name(f"{flow}/{name}")
        parameters = {"config": config(src, tiny_model, out).model_dump(mode="json", exclude_none=True)}
        runs[name] = client.create_flow_run_from_deployment(deployment.id, parameters=parameters).id
    with _worker(deployed, "test-worker", tmp_path / "worker.log") as worker:
        finished = {name: _wait_final(client, run_id, worker) for name, run_id in runs.items()}
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-4000:]
    assert all(run.state.is_completed() for run in finished.values()), worker_log
    assert json.loads((build_out / "cache.json").read_text())["fingerprint"]
    assert (build_out / "ledger" / "s.jsonl").is_file() and len(list(build_out.rglob("*.pt"))) == 2
    assert not sanity_out.exists() and (tmp_path / "checked.sanity").is_dir()  # nothing written into OUT
    artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id={"any_": [runs["sanity"]]}))
    assert "sanity" in {a.key for a in artifacts}


@pytest.mark.soak  # ~75 s: three deployment runs; `rerun --failed-only` itself is in tests/test_rerun.py
def test_rerun_failed_only_of_a_deployment_run_is_a_new_run_of_that_deployment(
    deployed, client, tiny_model, clips, tmp_path
):
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(tmp_path / "src", {"s": [sample(0, i, video, f"clip {i}".encode()) for i in range(2)]})
    out = tmp_path / "cache"
    deployment = client.read_deployment_by_name("build-cache/build-cache")

    def run(**overrides: Any) -> UUID:
        parameters = {"config": config(src, tiny_model, out, **overrides).model_dump(mode="json", exclude_none=True)}
        return client.create_flow_run_from_deployment(deployment.id, parameters=parameters).id

    with _worker(deployed, "rerun-worker", tmp_path / "worker.log") as worker:
        assert _wait_final(client, run(max_samples_per_shard=1), worker).state.is_completed()
        done = {p.relative_to(out).as_posix() for p in out.rglob("*.pt")}
        (first,) = done  # sample 0; sample 1 goes beside it: a stray file there makes it fail (output_exists)
        second = out / first.replace("00000000", "00000001")
        second.write_bytes(b"a stray file from another encoder")
        failing = run()
        assert _wait_final(client, failing, worker).state.is_completed()
        second.unlink()
        rerun = subprocess.run(
            [str(Path(sys.executable).with_name("latentforge")), "rerun", str(failing), "--failed-only"],
            env=deployed, capture_output=True, text=True,
        )  # fmt: skip
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        new_id = UUID(rerun.stdout.split("started ")[1].split()[0])
        new = _wait_final(client, new_id, worker)
    assert new.state.is_completed(), (tmp_path / "worker.log").read_text(errors="replace")[-3000:]
    assert new.deployment_id == deployment.id and f"rerun-of:{failing}" in new.tags
    only = new.parameters["config"]["selection"]["only"]
    assert len(only) == 1 and only[0].startswith("s/") and only[0].endswith("00000001")
    assert second.is_file() and second.read_bytes() != b"a stray file from another encoder"


# --- automations ------------------------------------------------------------------------------------------


@pytest.fixture
def webhook() -> Iterator[Receiver]:
    """A loopback HTTP receiver of the notifications."""
    with receiver() as hook:
        yield hook


SLEEPER = """
import time
from prefect import flow

@flow(name="build-cache", flow_run_name="{name}")
def stand_in() -> None:  # a run of a watched flow, to be SIGKILLed
    time.sleep(300)

stand_in()
"""


def _heartbeats(api_url: str, run_id: UUID) -> list[dict[str, Any]]:
    events = {"event": {"name": ["prefect.flow-run.heartbeat"]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]}}
    return httpx.post(f"{api_url}/events/filter", json={"filter": events}).json()["events"]


def _until(predicate: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {seconds} s")


def _running(client: SyncPrefectClient, name: str) -> FlowRun | None:
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [name]}))
    return runs[0] if runs and runs[0].state is not None and runs[0].state.is_running() else None


def _save_block(api_url: str, webhook_url: str, name: str) -> UUID:
    """A CustomWebhookNotificationBlock posting {"subject", "body"} as JSON to webhook_url."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock  # noqa: PLC0415

    block = CustomWebhookNotificationBlock(
        name="latentforge", url=webhook_url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    )
    with temporary_settings({PREFECT_API_URL: api_url}):
        return block.save(name, overwrite=True)


def _install(api_url: str, webhook_url: str, tmp_path: Path) -> tuple[UUID, Path]:
    """Save the webhook block, fill its id into the file (heartbeat window shortened), write it to tmp_path."""
    block_id = _save_block(api_url, webhook_url, "latentforge-alerts")
    data = yaml.safe_load(render_automations(AUTOMATIONS.read_text(), str(block_id)))
    data["automations"][0]["trigger"]["within"] = HEARTBEAT_TEST_WITHIN  # only the wait differs from the file
    rendered = tmp_path / "automations.yaml"
    rendered.write_text(yaml.safe_dump(data))
    return block_id, rendered


def test_automations_file_is_accepted_and_a_killed_run_is_crashed_and_reported(
    prefect_server, client, webhook, tmp_path
):
    url = webhook.url
    api_url = prefect_server["PREFECT_API_URL"]
    block_id, rendered = _install(api_url, url, tmp_path)
    created = subprocess.run(
        [PREFECT, "automation", "create", "--from-file", str(rendered)],
        env=prefect_server, capture_output=True, text=True,
    )  # fmt: skip
    assert created.returncode == 0 and "Created 2 automation(s)" in created.stdout, created.stdout + created.stderr
    names = [a["name"] for a in yaml.safe_load(rendered.read_text())["automations"]]
    automations = [a for name in names for a in client.read_automations_by_name(name)]
    try:
        assert [a.trigger.posture.value for a in automations] == ["Proactive", "Reactive"]
        assert automations[1].actions[0].block_document_id == block_id
        name = f"stand-in-{uuid4().hex[:8]}"
        env = {**prefect_server, **JOB_ENV}
        sleeper = subprocess.Popen([sys.executable, "-c", SLEEPER.format(name=name)], env=env, start_new_session=True)
        try:
            run = _until(lambda: _running(client, name), 60, "running stand-in run")
            _until(lambda: _heartbeats(api_url, run.id), 30, "heartbeat")
        finally:
            os.killpg(sleeper.pid, signal.SIGKILL)
            sleeper.wait()
        _until(lambda: client.read_flow_run(run.id).state.is_crashed(), 60, "Crashed state")
        body = webhook.wait_for(lambda b: isinstance(b, dict) and name in b.get("subject", ""), timeout=30)
        assert "Crashed" in body["subject"] and "No heartbeat" in body["body"]
    finally:
        for automation in automations:
            client.delete_automation(automation.id)


def test_latentforge_server_automations_fills_the_block_id_and_replaces_by_name(prefect_server, client):
    api_url = prefect_server["PREFECT_API_URL"]
    block_id = _save_block(api_url, "http://127.0.0.1:9/unused", "latentforge-alerts-cli")
    args = ["server", "automations", "--block", "custom-webhook/latentforge-alerts-cli", "--api-url", api_url]
    names = [a["name"] for a in yaml.safe_load(AUTOMATIONS.read_text())["automations"]]
    try:
        for _ in range(2):  # a second install replaces, it does not duplicate
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0 and all(name in result.output for name in names), result.output
        automations = [a for name in names for a in client.read_automations_by_name(name)]
        assert len(automations) == 2 and automations[1].actions[0].block_document_id == block_id
        assert automations[0].trigger.within.total_seconds() == 90
        missing = CliRunner().invoke(app, [*args[:2], "--block", "custom-webhook/nope", *args[4:]])
        assert missing.exit_code == 2 and "no block" in missing.output
    finally:
        for name in names:
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)
