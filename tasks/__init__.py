"""Prefect tasks: thin typed wrappers over infra. Offline defaults are applied before Prefect is imported."""

from infra.runtime import apply_offline_defaults

apply_offline_defaults()
