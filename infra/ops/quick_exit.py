"""The terminal command's end without the interpreter's teardown.

When a build's command has finished, CPython's finalization frees the process's objects one by one (torch,
diffusers, transformers, Prefect, the models): ~2.5 s of CPU on a 2-core machine after a 28-clip build, with
nothing of the run's left to do. `finish` ends the process as the interpreter would, in the same order, and then
skips that teardown: the exit handlers run (Prefect's log and event workers drain, the embedded server stops,
logging flushes its handlers, temporary files are removed), the standard streams are flushed, and the process
exits with the command's status (``os._exit``).

The order is the interpreter's own (``Py_FinalizeEx``): threading's shutdown first (its exit hooks, which drain
executors and Prefect's log and event workers, and the join of non-daemon threads), then the `atexit` handlers.
Only the console entry point uses it (`flows.cli.main`), from the main thread: code that runs the CLI's `app`
in-process (tests, a notebook) never reaches it, and code that calls `main` gets no control back after it (a harness
hooks `finish`, as tests/test_early.py does, or registers an exit handler).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def status_of(code: object) -> int:
    """The exit status the interpreter gives ``SystemExit(code)`` (a message is written to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{code}\n")
    return 1


def finish(code: object) -> None:
    """End the process now with the status of ``SystemExit(code)``, after its threads and exit handlers; returns (the
    caller then exits the usual way) off the main thread, or where threading has no shutdown to run."""
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter runs first at its exit
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        return
    status = status_of(code)
    shutdown()  # threading's exit hooks (executors, Prefect's log and event workers), non-daemon threads joined
    atexit._run_exitfuncs()  # then every exit handler, last registered first
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
