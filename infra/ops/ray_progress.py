"""Sample counts of a run's shard tasks on Ray: one named actor per run, fed by every worker, read by the flow.

The shard tasks of a Ray run execute in Ray worker processes (on other hosts, too), where the flow's in-process
counts (`infra.preprocess.state.RunState`) are not. Each worker sends every finished row's status to the run's
actor (fire and forget); the flow reads the totals for the progress bar and the progress artifact.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import ray

logger = logging.getLogger(__name__)

#: How long the flow waits for the counts before showing the last ones it got.
READ_TIMEOUT = 5.0


@ray.remote(num_cpus=0)
class ProgressCounter:
    """Counts by status (and ``total``) of one run."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def add(self, status: str) -> None:
        self._counts[status] += 1
        self._counts["total"] += 1

    def counts(self) -> dict[str, int]:
        return dict(self._counts)


def actor_name(run_key: str) -> str:
    return f"latentforge-progress-{run_key}"


@contextlib.contextmanager
def counter(run_key: str, namespace: str) -> Iterator[None]:
    """The run's counter actor, alive while the run's tasks run (on the connected Ray cluster)."""
    actor = ProgressCounter.options(name=actor_name(run_key), namespace=namespace).remote()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        ray.kill(actor)
        _actor.cache_clear()


@functools.lru_cache(maxsize=8)
def _actor(run_key: str, namespace: str) -> Any:
    return ray.get_actor(actor_name(run_key), namespace=namespace)


def reporter(run_key: str, namespace: str) -> Callable[[Any], None]:
    """A row callback for a task in a Ray worker: the row's status to the run's actor; nothing when the run has
    none (a task run outside a flow's preprocess)."""
    try:
        actor = _actor(run_key, namespace)
    except ValueError:  # no such actor: nobody counts this run
        return lambda row: None
    return lambda row: actor.add.remote(row.status)


def counts(run_key: str, namespace: str) -> dict[str, int]:
    """The run's counts so far ({} when there is no actor or it does not answer in time)."""
    if not ray.is_initialized():
        return {}
    try:
        return ray.get(_actor(run_key, namespace).counts.remote(), timeout=READ_TIMEOUT)
    except (ValueError, ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
        logger.debug("progress of %s not read: %s", run_key, exc)
        return {}
