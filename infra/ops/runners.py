"""Where the shard tasks run: threads of the flow's process (local) or a Ray cluster (Prefect's RayTaskRunner).

Both runners take the same tasks and the same plan, so they write the same bytes; only where a task runs
differs. On Ray each shard (or chunk) is one Ray task with its resource request (a CPU; ``num_gpus=1`` on
cuda; ``neuron_cores=1`` on neuron), Ray workers are kept across tasks (``max_calls=0``) so a worker process
loads the models once and reuses them, and Ray itself never re-runs a task (``max_retries=0``): a task whose
worker was lost is resubmitted by the flow, as a new Prefect task run, wherever Ray places it.

Progress from tasks in other processes reaches the flow through a small Ray actor (`infra.ops.ray_progress`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from prefect.client.orchestration import get_client
from prefect.futures import PrefectFuture
from prefect.settings import PREFECT_API_URL
from prefect.states import Crashed
from prefect.tasks import Task

from infra.config import BuildConfig
from infra.errors import ConfigError
from infra.ops.progress import RunState

logger = logging.getLogger(__name__)

#: Marking a lost worker's task run Crashed: tries, and the wait between them (the run may not be recorded yet).
MARK_LOST_ATTEMPTS, MARK_LOST_WAIT_S = 10, 1.0
EXTRA_HINT = "pip install 'latentforge[ray]'"
#: Ray's namespace for the run's named actors (RayTaskRunner's default namespace).
NAMESPACE = "prefect"
#: Environment the Ray workers of a local cluster get from the flow's process (kill points, load counters, ...).
PASSED_ENV_PREFIXES = ("LATENTFORGE_", "PREFECT_", "OMP_NUM_THREADS", "HF_", "TOKENIZERS_")
#: Of those, the credentials (HF_TOKEN, PREFECT_API_KEY, LATENTFORGE_ALERT_WEBHOOK, ...) are never passed: Ray
#: writes a task's runtime environment into its logs (runtime_env_agent.log). A worker reads them from its own host's
#: environment (a local cluster's workers inherit the flow's process's).
SECRET_SUFFIXES = ("TOKEN", "_KEY", "SECRET", "PASSWORD", "WEBHOOK")
#: The ray.exceptions classes that mean "the process (or node) running the task is gone", not "the task failed".
LOST_WORKER_ERRORS = (
    "WorkerCrashedError",
    "NodeDiedError",
    "LocalRayletDiedError",
    "ObjectLostError",
    "OutOfMemoryError",  # Ray's memory monitor killed the worker
)

#: The directory holding flows/, tasks/ and infra/ (what a local cluster's workers import).
CODE_ROOT = str(Path(__file__).resolve().parents[2])

Submit = Callable[[Task, dict[str, Any]], PrefectFuture]


def require_ray() -> tuple[ModuleType, ModuleType]:
    """(ray, prefect_ray), or a ConfigError that names the extra to install."""
    try:
        import prefect_ray  # noqa: PLC0415 - an optional extra, imported where used
        import prefect_ray.context  # noqa: PLC0415
        import ray  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            f"--runner ray needs Ray and prefect-ray, which are not installed ({exc}): {EXTRA_HINT}"
        ) from exc
    return ray, prefect_ray


def remote_options(config: BuildConfig) -> dict[str, Any]:
    """The Ray resource request of one shard task for the configured device."""
    options: dict[str, Any] = {"num_cpus": 1, "max_retries": 0, "max_calls": 0}
    device = config.run.device
    if device == "auto":
        from infra.devices import resolve_device  # noqa: PLC0415 - torch only when asked

        device = resolve_device("auto").type
    if device == "cuda":
        options["num_gpus"] = 1
    elif device in ("neuron", "xla"):
        options["resources"] = {"neuron_cores": 1}
    return options


def worker_env(api_url: str | None, *, other_hosts: bool = False) -> dict[str, str]:
    """Environment for Ray workers: this process's latentforge/Prefect settings but credentials (`SECRET_SUFFIXES`),
    and the API to report to. For a
    cluster of other hosts (`other_hosts`) the settings whose value is a path of this machine (PREFECT_HOME, HF_HOME,
    LATENTFORGE_CACHE_DIR, ...) are left out: a worker keeps its Prefect home, its fetched models and its temporary
    files in its own host's folders (its HOME, TMPDIR, XDG_CACHE_HOME), never in a path the driver named."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES) and not k.endswith(SECRET_SUFFIXES)}
    if other_hosts:
        env = {k: v for k, v in env.items() if not Path(v).expanduser().is_absolute()}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _api_url() -> str | None:
    """The Prefect API the workers must report to: the configured one, else this process's ephemeral server."""
    if PREFECT_API_URL.value():
        return str(PREFECT_API_URL.value())
    from prefect.client.orchestration import get_client  # noqa: PLC0415 - heavy: Prefect's client, Ray only

    try:  # the client of a flow without PREFECT_API_URL talks to Prefect's ephemeral server (the flow's own)
        with get_client(sync_client=True) as client:
            return str(client.api_url).rstrip("/")
    except ValueError:  # no API configured and Prefect's ephemeral mode switched off
        return None


def init_kwargs(config: BuildConfig) -> dict[str, Any]:
    """ray.init arguments: a local cluster of `config.run.workers` CPUs, or the given address; workers get the API."""
    api_url = _api_url()
    if config.run.ray_address and api_url and ("127.0.0.1" in api_url or "localhost" in api_url):
        logger.warning(
            "Ray workers on other hosts cannot reach the Prefect API at %s: set PREFECT_API_URL to a server they "
            "can reach (infra/deploy/ray/README.md)",
            api_url,
        )
    env = worker_env(api_url, other_hosts=bool(config.run.ray_address))
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "runtime_env": {"env_vars": env}}
    if not config.run.ray_address:  # a local cluster runs this checkout (a remote one: what its hosts installed)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE_ROOT, os.environ.get("PYTHONPATH")) if p)
        kwargs.update(num_cpus=config.run.workers, include_dashboard=False)
    return kwargs


@contextlib.contextmanager
def shard_runner(config: BuildConfig, run_key: str) -> Iterator[Submit]:
    """A submit function for the shard tasks of one run, on the configured runner (entered for the run's
    preprocess: a local Ray cluster is started here and stopped at the end)."""
    if config.run.runner == "local":
        yield lambda task, parameters: task.submit(**parameters)
        return
    ray, prefect_ray = require_ray()
    from infra.ops import ray_progress  # noqa: PLC0415 - imports ray

    runner = prefect_ray.RayTaskRunner(address=config.run.ray_address, init_kwargs=init_kwargs(config))
    options = remote_options(config)
    with runner, ray_progress.counter(run_key, NAMESPACE):
        resources = ray.cluster_resources()
        logger.info("Ray cluster: %s; each shard task asks for %s", resources, options)
        wanted = {**options.get("resources", {}), **({"GPU": 1} if "num_gpus" in options else {})}
        missing = [name for name in wanted if resources.get(name, 0) < 1]
        if missing:
            raise ConfigError(f"the Ray cluster has no {', '.join(missing)} for the shard tasks: {resources}")

        def submit(task: Task, parameters: dict[str, Any]) -> PrefectFuture:
            with prefect_ray.context.remote_options(**options):
                return runner.submit(task, parameters)

        yield submit


def row_reporter(run: RunState) -> Callable[[Any], None]:
    """Where a shard task reports each finished row: the run's own counts (the task runs in the flow's process),
    else (a copy of the run's state in a Ray worker) the run's progress actor; a no-op when neither is there."""
    if run.counting:
        return run.report
    if "ray" in sys.modules:
        from infra.ops import ray_progress  # noqa: PLC0415 - only inside a Ray worker

        return ray_progress.reporter(run.run_key, NAMESPACE)
    return lambda row: None


def snapshot(run: RunState) -> dict[str, int]:
    """Counts so far of every task of the run, wherever it ran."""
    counts = run.snapshot()
    if "ray" in sys.modules:
        from infra.ops import ray_progress  # noqa: PLC0415 - optional: imports ray

        for name, value in ray_progress.counts(run.run_key, NAMESPACE).items():
            counts[name] = counts.get(name, 0) + value
    return counts


def worker_lost(exc: BaseException) -> bool:
    """Whether `exc` says the process or node running a task is gone (resubmit), not that the task failed."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    lost = tuple(getattr(ray.exceptions, name) for name in LOST_WORKER_ERRORS if hasattr(ray.exceptions, name))
    return isinstance(exc, lost)


def mark_lost(task_run_id: Any, error: BaseException) -> None:
    """Record a task run whose worker was lost as Crashed (else it would stay Running in the UI forever);
    best effort: the run goes on either way."""
    message = f"its Ray worker was lost ({type(error).__name__}); the flow submitted the task again"
    for attempt in range(MARK_LOST_ATTEMPTS):
        try:
            with get_client(sync_client=True) as client:
                client.set_task_run_state(task_run_id, Crashed(message=message), force=True)
            return
        except Exception as exc:  # noqa: BLE001 - a record the UI shows, never a reason to stop the run
            # The server records task runs from their events, a moment after the worker sent them: a run not
            # found yet is asked for again.
            if "404" in str(exc) and attempt + 1 < MARK_LOST_ATTEMPTS:
                time.sleep(MARK_LOST_WAIT_S)
                continue
            logger.warning("task run %s not marked Crashed: %s: %s", task_run_id, type(exc).__name__, exc)
            return
