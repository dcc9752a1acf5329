"""The errors latentforge raises on purpose, and the command line's exit codes, decided here only.

Every such error derives from `LatentforgeError` and carries the exit code the CLI ends with. Bad input of
one sample is not an error of the run: `InputError` becomes a ledger row with its reason.
"""

from __future__ import annotations

from typing import ClassVar

#: Exit codes of the `latentforge` command.
EXIT_OK = 0
EXIT_FAILED = 1  # the run or the check ran and found a problem (a gate, a conflict, a shortfall, a mismatch)
EXIT_USAGE = 2  # the command could not run as given (bad flags or config, unknown names, missing model parts)
#: Stopped by SIGTERM or Ctrl-C (SIGINT): what was done is sealed; the same command again resumes. 75 is sysexits'
#: EX_TEMPFAIL ("try again later"), so a scheduler can tell a preempted run from a failed one and restart it.
EXIT_PREEMPTED = 75


class LatentforgeError(Exception):
    """Base of every error latentforge raises on purpose; `exit_code` is what the CLI exits with. Its message is one
    line (what happened, and the flag or command that answers it: a Prefect Failed state shows it); `detail`, lines
    printed after it (what differs, who decided), may be empty."""

    exit_code: ClassVar[int] = EXIT_FAILED

    def __init__(self, *args: object, detail: str = "") -> None:
        super().__init__(*args)
        self.detail = detail


class ConfigError(LatentforgeError, ValueError):
    """A configuration that cannot run (bad geometry, unknown family, missing model part)."""

    exit_code = EXIT_USAGE


class SourceError(ConfigError):
    """A source that cannot be listed at all (bad path, no shards)."""


class NoServerError(ConfigError):
    """The command needs a Prefect server that other processes can reach."""


class QuantizeOffCpu(ConfigError):
    """``--text-quantize int8-dynamic`` on an accelerator: torch's dynamic int8 quantization is CPU-only. Raised by
    the config when the device is named, by the model load when ``--device auto`` resolves to one."""

    def __init__(self, device: str) -> None:
        super().__init__(
            f"--text-quantize int8-dynamic is torch's CPU dynamic quantization; on {device} there is no 8-bit text "
            "encoder here (bitsandbytes is not wired in): use --device cpu or --text-quantize none"
        )


class InputError(LatentforgeError):
    """A sample's input cannot be used. `reason` is a short code for the ledger and reports."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # pickled as its own arguments (the default, `args`, is the one message): it crosses to and from a decoder
        # process or a Ray worker with its reason and detail
        return type(self), (self.reason, self.detail)


class ConflictError(LatentforgeError, RuntimeError):
    """OUT holds something that this run must not write over."""


class GateFailed(LatentforgeError, RuntimeError):
    """A gate (sanity, disk, reconciliation, audio, decode, upload) stopped the run; the message says why."""


class ModelLoadError(LatentforgeError, RuntimeError):
    """The model could not be loaded: a problem of the run, not of one sample."""


class PublishError(LatentforgeError, RuntimeError):
    """The upload or the remote verification failed; the message says what and where."""


class ServerError(LatentforgeError, RuntimeError):
    """The Prefect server or the worker could not be started, stopped or read."""


class DamagedCacheError(LatentforgeError, RuntimeError):
    """A file of the cache does not load safely (``weights_only=True``) or is not what its ledger says."""


class LedgerError(LatentforgeError, ValueError):
    """A ledger that cannot be read (a corrupt line anywhere but a journal's torn tail)."""


class Preempted(LatentforgeError, RuntimeError):
    """SIGTERM or Ctrl-C stopped the run: finished samples are sealed in their ledgers; rerunning resumes."""

    exit_code = EXIT_PREEMPTED


class OutWriteError(LatentforgeError, RuntimeError):
    """A write under OUT that no later sample would get past either (a whole-OUT problem): the run stops at the first
    one with one line instead of failing sample after sample; finished samples are kept, nothing partial; fixed, the
    same command resumes."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class DiskFull(OutWriteError):
    """OUT's file system ran out of space (ENOSPC) mid-run: nothing partial was kept; free space and rerun."""


class OutNotWritable(OutWriteError):
    """OUT, or a folder in it, refuses writes (read-only file system, permissions) mid-run: fix it and rerun."""


class LeaseLost(OutWriteError):
    """This run's lease on an OUT in an object store was taken by another run (or ran out unrenewed): the run stops
    writing at once, every later put refused in this process (`infra.cache.lock`)."""


class RunFailed(LatentforgeError, RuntimeError):
    """A flow run ended failed; the message is its error."""


def exit_code(exc: BaseException) -> int:
    """The CLI's exit code for an error that ends a command."""
    if isinstance(exc, LatentforgeError):
        return exc.exit_code
    return EXIT_USAGE if isinstance(exc, ValueError | OSError) else EXIT_FAILED
