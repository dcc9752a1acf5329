"""Model families: a registry (name → spec), detection from model_index.json, cached loading."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import torch

from infra.errors import ConfigError
from infra.models import memory
from infra.models.base import (
    ROLE_MEDIA,
    ROLES,
    TEXT_TO_VIDEO,
    FamilySpec,
    GeometryRules,
    LoadedFamily,
    TextEmbedding,
    declared_modes,
    mode_roles,
    read_json,
    role_kinds,
)
from infra.models.h3 import H3Spec
from infra.models.hv15 import Hv15Spec
from infra.models.identity import Scheme, component_identity
from infra.models.image import ImageSpec
from infra.models.ltx2 import Ltx2Spec
from infra.models.memory import LoadOptions
from infra.models.plugins import PLUGIN_KEY, as_family, is_builtin, load_module_attr, plugin_identity
from infra.models.qwen_image import QwenImageSpec
from infra.models.wan21 import Wan21Spec
from infra.models.wan22 import Wan22Spec
from infra.registry import Registry

FAMILIES: Registry[FamilySpec] = Registry("family", plural="families", entry_points="latentforge.families")
FAMILIES.add("wan22", Wan22Spec())
FAMILIES.add("ltx2", Ltx2Spec())
FAMILIES.add("image", ImageSpec())
FAMILIES.add("wan21", Wan21Spec())
FAMILIES.add("qwen-image", QwenImageSpec())
FAMILIES.add("h3", H3Spec())
FAMILIES.add("hv15", Hv15Spec())

__all__ = [
    "FAMILIES",
    "ROLES",
    "ROLE_MEDIA",
    "TEXT_TO_VIDEO",
    "FamilySpec",
    "GeometryRules",
    "LoadedFamily",
    "TextEmbedding",
    "check_model_dir",
    "declared_modes",
    "get_family",
    "load_family",
    "makers",
    "mode_roles",
    "model_identity",
    "resolve_family",
    "role_kinds",
]


def get_family(name: str) -> FamilySpec:
    """The family registered under `name` (an installed plugin's entry point too), or ``module:attr`` imported
    and registered under that name (`infra.models.plugins`)."""
    if name not in FAMILIES and ":" in name:
        return FAMILIES.add(name, load_module_attr(name))
    family = FAMILIES.get(name)
    if family.name != name:  # a plugin whose class names itself otherwise: the registry's name is the one kept
        family = FAMILIES.replace(name, as_family(family, name))
    return family


def makers(mode: str) -> list[FamilySpec]:
    """The registered families that make `mode` (`FamilySpec.modes`), in the registry's order."""
    return [family for name in FAMILIES.names() if mode in (family := get_family(name)).modes]


def resolve_family(model_dir: Path, name: str | None, audio: bool = False) -> FamilySpec:
    """The named family, or the one whose detection matches model_index.json; check the directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"--model {model_dir}: not a directory (models load from local paths only)")
    index = model_index(model_dir)
    if name is not None:
        family = get_family(name)
    else:
        FAMILIES.load_plugins()
        found = [get_family(n) for n in FAMILIES.names() if get_family(n).matches(model_dir, index)]
        if not found:
            raise ConfigError(_unknown_family(model_dir, index, audio))
        family = found[0]
    check_model_dir(model_dir, family, audio)
    return family


#: The files a snapshot's index may be in: a pipeline's, else a Modular Diffusers repository's.
INDEX_FILES = ("model_index.json", "modular_model_index.json")


def model_index(model_dir: Path) -> dict[str, Any]:
    """The snapshot's index (`INDEX_FILES`, the first there), or {} without one: what `FamilySpec.matches` reads."""
    found = next((model_dir / name for name in INDEX_FILES if (model_dir / name).exists()), None)
    return read_json(found) if found is not None else {}


def _unknown_family(model_dir: Path, index: dict[str, Any], audio: bool) -> str:
    """Why no family was told from `model_dir`, and what each family would miss there (a bare "pass --family" sent
    the user to a family that then failed on its missing components)."""
    if index:
        why = f"its index names no known family (_class_name={index.get('_class_name')!r})"
    else:
        why = "no model_index.json (or modular_model_index.json) to tell the family from"
    ready, missing = [], []
    for name in FAMILIES.names():
        family = get_family(name)
        try:
            lacks = [c + "/" for c in family.components_in(model_dir, audio) if not (model_dir / c).is_dir()]
        except (OSError, ValueError, ConfigError):  # a family that cannot read this folder at all
            continue
        if lacks:
            missing.append(f"{name} lacks {', '.join(lacks)}")
        else:
            ready.append(name)
    fits = f"; all of --family {' or --family '.join(ready)}'s components are here" if ready else ""
    return f"{model_dir}: {why}; what each family needs and this folder lacks: {'; '.join(missing)}{fits}"


def check_model_dir(model_dir: Path, family: FamilySpec, audio: bool = False) -> None:
    """Every component the family reads must be there (a missing transformer/ is normal)."""
    needed = family.components_in(model_dir, audio)
    missing = [c for c in needed if not (model_dir / c).is_dir()]
    if missing:
        raise ConfigError(
            f"{model_dir}: missing {', '.join(c + '/' for c in missing)} needed by family {family.name} "
            f"(encoding reads {', '.join(needed)}; transformer/ is not needed)"
        )


def model_identity(
    model_dir: Path, family: FamilySpec, scheme: Scheme = "content", audio: bool = False
) -> dict[str, str]:
    """Per component the family reads: the hash of every byte of its files (`infra.models.identity`); a plugin
    family adds its code's identity under ``family_plugin`` (`infra.models.plugins.plugin_identity`)."""
    components = family.components_in(Path(model_dir), audio)
    identity = {c: component_identity(Path(model_dir) / c, scheme) for c in components}
    if not is_builtin(family):
        identity[PLUGIN_KEY] = plugin_identity(family)
    return identity


_load_lock = threading.Lock()


#: A directory where every model load appends a line to ``<pid>.loads`` (how tests count loads per process).
LOAD_LOG_ENV = "LATENTFORGE_LOAD_LOG"


@functools.lru_cache(maxsize=2)
def _load(
    model_dir: str, family: str, device: str, dtype: torch.dtype, files: tuple, options: LoadOptions
) -> LoadedFamily:
    # only a family declaring `text_8bit` takes the keyword (the plan refuses the setting for the others)
    extra = {"text_encoder_8bit": True} if options.text_8bit else {}
    loaded = get_family(family).load(Path(model_dir), torch.device(device), dtype, **extra)
    memory.apply(loaded, options)
    if log := os.environ.get(LOAD_LOG_ENV):
        with open(Path(log) / f"{os.getpid()}.loads", "a", encoding="utf-8") as fh:
            fh.write(f"{family} {model_dir}\n")
    return loaded


def _files_signature(model_dir: Path) -> tuple:
    """(path, size, mtime_ns, inode) of every file under the model dir: a directory changed on disk since it was
    loaded (weights replaced, removed, added) is loaded again, not answered from memory under a new fingerprint."""
    stats = ((p, p.stat()) for p in sorted(model_dir.rglob("*")) if p.is_file())
    return tuple((str(p.relative_to(model_dir)), st.st_size, st.st_mtime_ns, st.st_ino) for p, st in stats)


def load_family(
    model_dir: Path, family: str, device: torch.device, dtype: torch.dtype, options: LoadOptions | None = None
) -> LoadedFamily:
    """Load once per process and reuse: every shard task of a run shares one set of models (one per set of memory
    `options`: `infra.models.memory`)."""
    resolved = Path(model_dir).resolve()
    with _load_lock:  # one load at a time: lazy imports are not thread-safe, and memory is not doubled
        return _load(str(resolved), family, str(device), dtype, _files_signature(resolved), options or LoadOptions())
