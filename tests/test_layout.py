"""The layout holds its promises: arrows point flows → tasks → infra, no import cycle, every infra folder in
ARCHITECTURE.md's map, and every contract fails loudly when a piece of it is missing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from infra.config import STEP_SETTINGS, BuildConfig, step_settings
from infra.formats.base import Format
from infra.models.base import FamilySpec
from infra.publish.base import Remote
from infra.registry import Registry
from infra.sources.base import Source

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "infra")


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the project that `path` imports, at the top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in modules}


def test_arrows_point_one_way_and_no_module_imports_itself_round_a_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    backwards = [(a, b) for a, deps in graph.items() for b in deps if rank[b.split(".")[0]] < rank[a.split(".")[0]]]
    assert backwards == []
    top_level = {name: {m for m in deps if _at_top(modules[name], m)} for name, deps in graph.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for dep in sorted(top_level[name]):
            assert seen.get(dep) != 1, f"import cycle: {' → '.join([*path, name, dep])}"
            if dep not in seen:
                visit(dep, [*path, name])
        seen[name] = 2

    for name in sorted(top_level):
        if name not in seen:
            visit(name, [])


def _at_top(path: Path, module: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.module == module or module.startswith(node.module + "."))
        ):
            return True
        if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
            return True
    return False


def test_the_architecture_map_names_every_infra_folder():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    folders = sorted(p.name for p in (ROOT / "infra").iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders and [f for f in folders if f"infra/{f}/" not in text] == []


def test_the_config_is_the_ground_floor_and_every_step_names_real_settings():
    modules = _modules()
    assert _imports(ROOT / "infra" / "config.py", modules) == {"infra.errors"}  # nothing above it
    for step in STEP_SETTINGS:
        assert set(step_settings(step)) <= set(BuildConfig.settings()), step


@pytest.mark.parametrize("contract", [Source, Format, FamilySpec, Remote])
def test_a_contract_with_a_missing_method_fails_at_construction(contract):
    incomplete = type(f"Incomplete{contract.__name__}", (contract,), {"name": "x", "keys": {}, "components": ()})
    with pytest.raises(TypeError, match="abstract"):
        incomplete()


def test_a_family_or_format_that_does_not_declare_its_names_fails_at_import():
    with pytest.raises(TypeError, match="does not declare name"):
        type("Nameless", (Format,), {"writer": None, "paths": None, "read": None, "keys": {}})
    methods = dict.fromkeys(("matches", "rules", "latent_shape", "text_shape", "load"))
    with pytest.raises(TypeError, match="does not declare components"):
        type("Partless", (FamilySpec,), {**methods, "name": "x", "latent_norm": "n"})


def test_one_registry_error_for_every_kind():
    registry: Registry[int] = Registry("widget")
    registry.add("a", 1)
    with pytest.raises(ValueError, match=r"unknown widget 'b'; known widgets: a"):
        registry.get("b")
    from infra.formats import get_format  # noqa: PLC0415
    from infra.models import get_family  # noqa: PLC0415
    from infra.sources import open_source  # noqa: PLC0415

    for lookup, kind in (
        (get_format, "format"),
        (get_family, "family"),
        (lambda n: open_source(f"{n}:x"), "source kind"),
    ):
        with pytest.raises(ValueError, match=rf"unknown {kind} 'nope'; known "):
            lookup("nope")
