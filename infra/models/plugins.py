"""Families that live outside latentforge: an entry point in the group ``latentforge.families`` (an installed
package's ``[project.entry-points."latentforge.families"]``), or ``--family module:attr`` (any importable
module). The object is a `FamilySpec` subclass or instance; it is registered under the name it was asked by, so
a cache's ``spec.family`` finds it again in every later step (verify, reconcile, decode) and process.

A plugin's code is part of the cache's identity: `plugin_identity` records its distribution and version (where
it was installed as one) and the sha256 of the source file that defines it, so editing or upgrading a plugin
changes the fingerprint (resume is refused, as for changed weights).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import logging
import sys
from importlib import metadata
from pathlib import Path

from infra.errors import ConfigError
from infra.models.base import FamilySpec

logger = logging.getLogger(__name__)

#: The model_identity key under which a plugin family's code identity is recorded.
PLUGIN_KEY = "family_plugin"


def as_family(obj: object, name: str) -> FamilySpec:
    """A FamilySpec instance named `name` from a plugin's object (a subclass is instantiated); ConfigError for
    anything else."""
    if isinstance(obj, type) and issubclass(obj, FamilySpec):
        obj = obj()
    if not isinstance(obj, FamilySpec):
        raise ConfigError(f"family plugin {name!r} is a {type(obj).__name__}, not a FamilySpec (class or instance)")
    if obj.name != name:  # the registry name is the one a cache records and looks up again
        obj = copy.copy(obj)
        obj.name = name  # type: ignore[misc] - an instance attribute over the class's
    return obj


def load_module_attr(spec: str) -> FamilySpec:
    """``module:attr`` → the family it names (imported now)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--family {spec!r}: expected NAME or module:attr")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--family {spec!r}: cannot import {module_name}: {exc}") from exc
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"--family {spec!r}: {module_name} has no {attr}") from None
    return as_family(obj, spec)


def is_builtin(family: FamilySpec) -> bool:
    """True for the families latentforge ships (their code is versioned with it, not hashed)."""
    return type(family).__module__.startswith("infra.models.")


def plugin_identity(family: FamilySpec) -> str:
    """``DIST==VERSION;sha256:<source file>`` of a plugin family's defining module (``-`` where it is not from
    an installed distribution)."""
    module = sys.modules.get(type(family).__module__)
    source = inspect.getsourcefile(module) if module is not None else None
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else "unknown"
    top = type(family).__module__.partition(".")[0]
    dists = metadata.packages_distributions().get(top, [])
    release = f"{dists[0]}=={metadata.version(dists[0])}" if dists else "-"
    return f"{release};sha256:{digest}"
