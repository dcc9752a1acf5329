"""The disk gate: free space on OUT's file system against the bytes the run still has to write."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from infra.errors import DiskFull, LeaseLost, OutWriteError
from infra.outstore import StoreOut
from infra.report_files import human_bytes

DISK_MARGIN_PERCENT = 5  # on top of the bytes still to write


@dataclass
class DiskCheck:
    """Free space on OUT's file system against the bytes the run still has to write."""

    free_bytes: int
    needed_bytes: int
    current_cache_bytes: int
    ok: bool
    message: str


def check_disk(out: Path | StoreOut, projected_bytes: int) -> DiskCheck:
    """Free space on OUT's file system (OUT or its nearest existing parent) against what is left to write.

    needed = max(0, projected_bytes − current cache bytes (files under OUT, links not followed)) + 5%: what is
    on disk already counts as written (a resume); the margin covers the ledger, temp files and estimate error.
    An OUT in an object store has no free space to ask for: the gate passes, saying so (a store's quota, where it
    has one, stops the run at its first refused write with one line)."""
    if isinstance(out, StoreOut):
        message = f"disk check skipped: {out} is in an object store (no free space to ask for)"
        return DiskCheck(free_bytes=0, needed_bytes=0, current_cache_bytes=0, ok=True, message=message)
    out = Path(out).expanduser().absolute()
    probe = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    current = sum(p.lstat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink())
    left = max(0, int(projected_bytes) - current)
    needed = left + -(-left * DISK_MARGIN_PERCENT // 100)  # integer ceil: exact for any size
    ok = free >= needed
    sizes = f"the cache {out} holds {human_bytes(current)} and {human_bytes(free)} are free on {probe}"
    head = "disk ok" if ok else "not enough disk"
    message = f"{head}: {human_bytes(needed)} still to write (projection + {DISK_MARGIN_PERCENT}%); {sizes}"
    return DiskCheck(free_bytes=free, needed_bytes=needed, current_cache_bytes=current, ok=ok, message=message)


def disk_full_message(out: Path, cause: str) -> str:
    """What a run that hit a full disk (ENOSPC) says: the cache's size, the free space, and what to do."""
    out = Path(out).expanduser().absolute()
    probe = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    current = sum(p.lstat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink())
    return (
        f"disk full: {cause}; the cache {out} holds {current} bytes ({human_bytes(current)}) and {free} bytes "
        f"({human_bytes(free)}) are free on {probe}; finished samples are kept and no partial file was left: free "
        "some space and run the same command again: it resumes"
    )


def stopping_message(out: Path | StoreOut, exc: OutWriteError) -> str:
    """What a run stopped by a whole-OUT write error says: for a full disk the sizes (`disk_full_message`), for a
    refused write the path, and what to do; a lost lease its own line."""
    if isinstance(exc, LeaseLost):
        return str(exc)
    if isinstance(out, StoreOut):
        return (
            f"OUT not writable: {exc}; no later sample could be written either; finished samples are kept and no "
            "partial object was left: give this run write access to the store and run the same command again: it "
            "resumes"
        )
    if isinstance(exc, DiskFull):
        return disk_full_message(out, str(exc))
    return (
        f"OUT not writable: {exc}; the cache {Path(out).expanduser().absolute()} (or a folder in it) refuses writes, "
        "so no later sample could be written either; finished samples are kept and no partial file was left: make it "
        "writable and run the same command again: it resumes"
    )
