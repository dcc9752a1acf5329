"""torchvision's own released transforms, run from its wheel beside the project's CPU torch (tests only).

torchvision cannot be a dependency: the wheels published for torch 2.13 (``torchvision==0.28.0``) link its C++
extension against CUDA libtorch, and beside ``torch==2.13.0+cpu`` ``import torchvision`` fails with "operator
torchvision::nms does not exist" (its ``_meta_registrations.py`` registers fake kernels for ops its ``_C.so``
would have defined). The transforms used here (``Resize`` on a PIL image, ``CenterCrop``, ``ToTensor``,
``Normalize``) are pure Python and call none of those ops, so:

* ``pip download torchvision==0.28.0 --no-deps`` goes into the test-media cache (`fetch_package`), and only the
  wheel's ``.py`` files are extracted beside it (no ``.so``: nothing CUDA-linked is ever loaded);
* the C++ detection ops' names (``nms``, ``roi_align`` ...: every op ``_meta_registrations.py`` registers) are
  declared in a ``torch.library.Library("torchvision", "DEF")`` with a placeholder schema, so that module's
  ``register_fake`` calls find an op to attach to. No transform calls them; calling one would fail (no kernel).
  The Library object is held for the process (`torchvision_transforms` is cached): dropping it removes the ops.
"""

from __future__ import annotations

import functools
import importlib
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

import torch

from infra.demo.testmedia import fetch_package, media_cache_dir

TORCHVISION = "torchvision==0.28.0"
META = "torchvision/_meta_registrations.py"


def torchvision_dir() -> Path:
    """The wheel's Python files, extracted once into the media cache: ``<cache>/torchvision-0.28.0/torchvision``."""
    target = media_cache_dir() / "torchvision-0.28.0"
    if (target / META).is_file():
        return target
    wheel = fetch_package(TORCHVISION)
    staging = Path(tempfile.mkdtemp(prefix=".tv-", dir=media_cache_dir()))
    try:
        with zipfile.ZipFile(wheel) as archive:
            python = [name for name in archive.namelist() if name.startswith("torchvision/") and name.endswith(".py")]
            archive.extractall(staging, python)
        if not target.exists():  # another process may have finished first
            staging.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@functools.cache
def torchvision_transforms() -> tuple[ModuleType, torch.library.Library]:
    """``torchvision.transforms`` of the released wheel, and the Library that declares the C++ op names (hold it)."""
    root = torchvision_dir()
    source = (root / META).read_text(encoding="utf-8")
    names = set(re.findall(r'register_meta\("(\w+)"', source)) | set(
        re.findall(r'register_fake\("torchvision::(\w+)"', source)
    )
    library = torch.library.Library("torchvision", "DEF")
    for name in sorted(names):  # placeholder schemas: the names exist, no kernel does (no transform calls them)
        library.define(f"{name}(Tensor x) -> Tensor")
    sys.path.insert(0, str(root))
    try:
        transforms = importlib.import_module("torchvision.transforms")
    finally:
        sys.path.remove(str(root))
    if not str(Path(transforms.__file__)).startswith(str(root)):  # never an installed torchvision by accident
        raise ImportError(f"torchvision came from {transforms.__file__}, not the {TORCHVISION} wheel")
    return transforms, library
