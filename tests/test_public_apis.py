"""Other packages are used through their public names only (STYLE.md 14): no code under flows/, tasks/ or infra/
reads or imports an underscore name that the project does not define itself, nor imports Prefect's server
implementation (``prefect.server``: the client, the CLI and ``prefect.flow_runs`` / ``prefect.input`` are its public
face). A private name breaks silently on the next release of its package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "infra")
#: Demo material, never run by a build: the tiny-VAE fitter reads a causal convolution's ``_padding`` (diffusers
#: keeps it nowhere public) to refit the weights it mirrors.
EXEMPT = ("infra/demo/vae_fit/",)
#: Underscore names documented as public by their owner: ``os._exit`` (the Python docs' process management).
DOCUMENTED = {"_exit"}
#: Modules of another package that are not its public interface.
INTERNAL_MODULES = ("prefect.server",)


def _trees() -> dict[str, ast.Module]:
    files = [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Every name the project binds itself: definitions, assignments, ``self.``/``cls.`` attributes, arguments."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in DOCUMENTED


def foreign_private_names(trees: dict[str, ast.Module]) -> list[str]:
    """``path:line name`` of each read of another package's private name, and each import of one."""
    own, found = _own_names(trees), []
    for path, tree in trees.items():
        if path.startswith(EXEMPT):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                found.append(f"{path}:{node.lineno} .{node.attr}")
            modules = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
                found += [f"{path}:{node.lineno} {node.module}.{a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for module in modules:
                parts = module.split(".")
                if module.startswith(INTERNAL_MODULES) or any(_private(part) for part in parts):
                    found.append(f"{path}:{node.lineno} import {module}")
    return found


def test_no_private_name_of_another_package_is_used():
    assert foreign_private_names(_trees()) == []


def test_the_scan_sees_a_private_cache_an_internal_module_and_a_private_import():
    code = """
from prefect.server.api.server import SubprocessASGIServer
from torch.nn.modules.module import _global_forward_hooks
import prefect._internal.compatibility
class Ours:
    def __init__(self):
        self._mine = 1
    def read(self, vae):
        vae._conv_idx = [0]
        return self._mine, vae._feat_map, os._exit
"""
    found = foreign_private_names({"infra/x.py": ast.parse(code)})
    assert [f.split(" ", 1)[1] for f in found] == [
        "import prefect.server.api.server",
        "torch.nn.modules.module._global_forward_hooks",
        "import prefect._internal.compatibility",
        "._conv_idx",
        "._feat_map",
    ]
