"""The run's progress: its sample counts and its stop check, made by the flow and passed to every shard task.

On the Ray runner a shard task runs in another process and gets a pickled copy of the run's state: it arrives with
the run's key and stop check and without counts (those stay in the flow's process; a worker's rows reach them
through the run's progress actor, `infra.ops.runners.row_reporter`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from infra.cache.ledger import LedgerRow
from infra.ops import preempt

StopCheck = Callable[[], str | None]


class RunState:
    """One run's sample counts (total, done, skipped, failed) and its stop check: the signal that asked the run to
    stop between samples, or None. A plain class, not a dataclass: Prefect passes a task's parameters through as
    they are (it rebuilds dataclasses and models it walks)."""

    def __init__(self, run_key: str, stop: StopCheck = preempt.requested, lease: tuple[str, str] | None = None) -> None:
        self.run_key = run_key
        self.stop = stop
        self.lease = lease  # (OUT's URL, token) of the run's lease on a store OUT: `infra.cache.lock.follow`
        self._counts: Counter[str] | None = Counter()
        self._lock = threading.Lock()

    @property
    def counting(self) -> bool:
        """Whether this copy counts the run's rows: the flow's own, not one pickled into another process."""
        return self._counts is not None

    def report(self, row: LedgerRow) -> None:
        """Count one finished sample (a copy in another process counts nothing)."""
        with self._lock:
            if self._counts is not None:
                self._counts[row.status] += 1
                self._counts["total"] += 1

    def snapshot(self) -> dict[str, int]:
        """Counts so far: total, done, skipped, failed."""
        with self._lock:
            return dict(self._counts or {})

    def __getstate__(self) -> dict[str, Any]:
        return {"run_key": self.run_key, "stop": self.stop, "lease": self.lease}  # counts stay in the flow's process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.run_key, self.stop, self.lease = state["run_key"], state["stop"], state.get("lease")
        self._counts, self._lock = None, threading.Lock()
