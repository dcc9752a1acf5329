"""Per-run sample counters, shared by the shard tasks of a run (threads of one process; tasks in other processes
report through their runner: `infra.ops.runners.row_reporter`)."""

from __future__ import annotations

import threading
from collections import Counter

from infra.cache.ledger import LedgerRow

_lock = threading.Lock()
_runs: dict[str, Counter[str]] = {}


def start(run_key: str) -> None:
    """Begin counting for a run."""
    with _lock:
        _runs[run_key] = Counter()


def counting(run_key: str) -> bool:
    """Whether this process counts the run (its flow runs here)."""
    with _lock:
        return run_key in _runs


def report(run_key: str, row: LedgerRow) -> None:
    """Count one finished sample (no-op when nobody is counting, e.g. on a remote worker)."""
    with _lock:
        counter = _runs.get(run_key)
        if counter is not None:
            counter[row.status] += 1
            counter["total"] += 1


def snapshot(run_key: str) -> dict[str, int]:
    """Counts so far: total, done, skipped, failed."""
    with _lock:
        return dict(_runs.get(run_key, {}))


def finish(run_key: str) -> None:
    """Stop counting for a run."""
    with _lock:
        _runs.pop(run_key, None)
