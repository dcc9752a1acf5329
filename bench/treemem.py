"""The memory of a whole process tree, sampled: what a command costs the host, its helper processes included.

``wait4``'s peak RSS is the largest of the processes it reaped, one at a time: a build's forked decode-ahead child
and its spawned Prefect server are not added to it, and neither are files in ``/dev/shm`` (memory that no process
maps). `TreeMemory` samples, every `interval` seconds, the proportional set size (PSS: a page shared by n processes
counts 1/n to each, so pages shared across a fork are counted once) of the process and all its descendants, plus
the bytes held in `shm_dirs` (directories matched by glob patterns that it fills), and keeps the peak of the sum.
"""

from __future__ import annotations

import glob
import os
import threading
from pathlib import Path
from types import TracebackType

import psutil


def pss(pid: int) -> int:
    """Proportional set size of `pid` in bytes (0 once it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return 0


def tree_pss(pid: int) -> dict[int, int]:
    """PSS of `pid` and of every process below it, in bytes, by pid (empty once `pid` is gone)."""
    try:
        procs = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return {}
    return {p: pss(p) for p in procs}


def _label(pid: int) -> str:
    try:
        return " ".join(Path(arg).name for arg in psutil.Process(pid).cmdline())[:100]
    except psutil.Error:
        return "?"


def held_bytes(patterns: list[str]) -> int:
    """Bytes allocated to the files below the directories that match `patterns` (glob)."""
    total = 0
    for pattern in patterns:
        for directory in glob.glob(pattern):
            for root, _, files in os.walk(directory):
                for name in files:
                    try:
                        total += Path(root, name).stat().st_blocks * 512
                    except OSError:
                        continue  # consumed meanwhile
    return total


class TreeMemory:
    """Context manager: the peak of the tree's PSS + `held_bytes(shm_dirs)` while it is open, in ``peak``, and
    what made it up then, in ``at_peak`` (each process's PSS by its command line, and the held files')."""

    def __init__(self, pid: int, shm_dirs: list[str] | None = None, interval: float = 0.1) -> None:
        self.pid, self.shm_dirs, self.interval = pid, shm_dirs or [], interval
        self.peak = self.peak_pss = self.peak_held = 0
        self.at_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def sample(self) -> int:
        """One sample (also kept in the peaks)."""
        by_pid, held = tree_pss(self.pid), held_bytes(self.shm_dirs)
        rss = sum(by_pid.values())
        self.peak_pss, self.peak_held = max(self.peak_pss, rss), max(self.peak_held, held)
        if rss + held > self.peak:
            self.peak = rss + held
            self.at_peak = {f"{pid} {_label(pid)}": size for pid, size in by_pid.items()} | {"held files": held}
        return rss + held

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
