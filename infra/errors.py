"""Errors that are data: a bad input becomes a ledger row with a reason, never a crash."""

from __future__ import annotations


class InputError(Exception):
    """A sample's input cannot be used. `reason` is a short code for the ledger and reports."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ConfigError(ValueError):
    """A configuration that cannot run (bad geometry, unknown family, missing model part)."""


class ConflictError(RuntimeError):
    """OUT holds something that this run must not write over."""
