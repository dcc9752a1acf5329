"""Kill points for the crash-resume sweep: ``LATENTFORGE_KILL_AT=POINT[:N]`` SIGKILLs this process the N-th
time (default 1) it reaches `fault_point(POINT)`; ``LATENTFORGE_FAULT_LOG=FILE`` appends every point reached to
FILE (how the sweep finds which hit of a point falls mid-run). Unset (always, outside the crash tests), a point
is two environment lookups. Points are chosen by progress, not by clock, so a kill lands where it is meant to
on any machine.

Points: ``plan`` (planned, nothing written), ``sanity`` (the sanity sample encoded), ``decode`` (a sample's
frames decoded, not yet encoded), ``encode`` (encoded, not yet written), ``write`` (a file's bytes on disk
under its temporary name, not yet linked), ``sample`` (a row journalled: between samples), ``seal`` (a shard's
sealed ledger written, its journal not yet removed), ``part`` (a sample appended to an open shard part of the
webdataset or parquet format, the part not yet in place), ``shard`` (a shard done: between shards), ``verify`` (a
sample decoded back by decode-and-verify).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

ENV = "LATENTFORGE_KILL_AT"
LOG_ENV = "LATENTFORGE_FAULT_LOG"  # a file each point reached is appended to (the sweep's reference run)
POINTS = ("plan", "sanity", "decode", "encode", "write", "sample", "seal", "shard", "verify")
#: Points only a shard format's build reaches (tests/test_shard_resume.py sweeps them).
SHARD_POINTS = ("part",)
_hits: Counter[str] = Counter()
_lock = threading.Lock()


def fault_point(name: str) -> None:
    """SIGKILL this process here if ``LATENTFORGE_KILL_AT`` names this point and this is its N-th hit."""
    if log := os.environ.get(LOG_ENV):
        with _lock, open(log, "a", encoding="utf-8") as fh:
            fh.write(name + "\n")
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    with _lock:
        _hits[name] += 1
        if _hits[name] == int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
