"""Prefect flows and the CLI. Offline defaults are applied before Prefect is imported."""

from infra.runtime import apply_offline_defaults

apply_offline_defaults()
