"""FastVideo's own released parquet collate, loaded straight from its wheel (no fastvideo install).

``pip download fastvideo==0.2.1 --no-deps`` goes into the test-media cache (`infra.demo.testmedia.fetch_package`);
``fastvideo/dataset/utils.py`` imports only ``random``, ``typing``, numpy and torch, so that one file is extracted
beside the wheel and loaded as a module of its own (``fastvideo_dataset_utils``): importing it as
``fastvideo.dataset.utils`` would run ``fastvideo/__init__.py``, which pulls in the whole package and its
dependencies. No other fastvideo module is needed.
"""

from __future__ import annotations

import ast
import importlib.util
import zipfile
from pathlib import Path
from types import ModuleType

from infra.demo.testmedia import fetch_package, media_cache_dir
from infra.storage import atomic_write

FASTVIDEO = "fastvideo==0.2.1"
COLLATE_MEMBER = "fastvideo/dataset/utils.py"
#: What the collate's module may import: a new release that needs more is a failure to look at, not to hide.
ALLOWED_IMPORTS = {"random", "typing", "numpy", "torch"}


def fastvideo_collate() -> ModuleType:
    """FastVideo 0.2.1's ``fastvideo/dataset/utils.py`` as a module (``collate_rows_from_parquet_schema``, ``pad``)."""
    target = media_cache_dir() / "fastvideo-0.2.1" / "dataset_utils.py"
    if not target.is_file():
        with zipfile.ZipFile(fetch_package(FASTVIDEO)) as wheel:
            atomic_write(target, wheel.read(COLLATE_MEMBER), replace=True)
    imported = _imports(target)
    if not imported <= ALLOWED_IMPORTS:
        raise ImportError(f"{COLLATE_MEMBER} of {FASTVIDEO} imports {sorted(imported - ALLOWED_IMPORTS)}")
    spec = importlib.util.spec_from_file_location("fastvideo_dataset_utils", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _imports(path: Path) -> set[str]:
    """Top-level names of the modules a source file imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names
