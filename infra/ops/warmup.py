"""The imports a build makes first, made while its Prefect server starts (`infra.ops.ephemeral.start_tracked`).

The ephemeral server's process spends seconds of CPU on its own imports and database set-up before it answers,
and the run waits for it. The family's heavy modules (diffusers, transformers: imported by the first model load,
in the sanity) and Prefect's run engines are imported meanwhile on a thread, so on two or more cores that wait
does the import work the run would do after it. Imports only: nothing is loaded, hashed or written, and a module
that fails to import here is imported again, and fails with its own error, where the run needs it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path

from infra.config import BuildConfig

logger = logging.getLogger(__name__)

#: Imported by the first flow and task runs.
ENGINE_MODULES = ("prefect.flow_engine", "prefect.task_engine")


def modules_for(config: BuildConfig) -> list[str]:
    """``module`` or ``module:attribute`` names the run's first steps import: Prefect's engines, then the family's
    `load_imports` (none when the family cannot be told: the plan then says why)."""
    from infra.models import resolve_family  # noqa: PLC0415

    names = list(ENGINE_MODULES)
    try:
        family = resolve_family(Path(config.model).expanduser(), config.family, config.audio)
    except Exception as exc:  # noqa: BLE001 - the plan reports a bad model directory with its own error
        logger.debug("start-up imports: no family for %s (%s)", config.model, exc)
        return names
    return [*names, *family.load_imports]


def importer(names: list[str]) -> Callable[[], None]:
    """A callable that imports each of `names` (``module:attribute`` also reads the attribute: lazy modules such
    as diffusers import the submodule then), logging what fails at debug level."""

    def run() -> None:
        for name in names:
            module, _, attribute = name.partition(":")
            try:
                loaded = importlib.import_module(module)
                if attribute:
                    getattr(loaded, attribute)
            except Exception as exc:  # noqa: BLE001 - imported again where it is needed, failing there
                logger.debug("start-up import of %s failed: %s", name, exc)

    return run
