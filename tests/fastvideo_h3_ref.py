"""FastVideo 0.2.1's own MiniMax-H3 preprocessing code, taken from its wheel (no fastvideo install; tests only).

``pip download fastvideo==0.2.1 --no-deps`` is in the test-media cache (`tests.fastvideo_ref`). Its H3 media and
record functions live in modules whose imports pull the whole package (``reference.py`` imports
``fastvideo.models.vision_utils``; the preprocessing script its component loaders), so the functions are taken out
of their files by name (``ast``), unchanged, and run in a namespace holding only what they use: numpy, torch, PIL,
``math``, PyAV and the module constants their files define. ``dataset/dataloader/schema.py`` imports pyarrow only
and is loaded whole. One thing is the test's: the canvas. ``prepare_reference_frames`` resizes to
``resolve_canvas_size(width, height)`` (768 short edge), and a 1344x768 pass of even a tiny VAE is too slow here, so
the canvas function it calls answers the test's height and width; the resize it then does is its own.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import zipfile
from types import ModuleType
from typing import Any

import av
import numpy as np
import torch
from PIL import Image, ImageOps

from infra.demo.testmedia import media_cache_dir
from infra.storage import atomic_write
from tests.fastvideo_ref import FASTVIDEO, fetch_package

REFERENCE = "fastvideo/pipelines/basic/minimax_h3/reference.py"
PACKING = "fastvideo/pipelines/basic/minimax_h3/packing.py"
OVERFIT = "fastvideo/pipelines/preprocess/preprocess_minimax_h3_overfit.py"
SCHEMA = "fastvideo/dataset/dataloader/schema.py"
MEDIA_FUNCTIONS = (
    "_import_av",
    "_decode_audio_stream",
    "decode_reference_video",
    "resample_reference_frames",
    "prepare_reference_frames",
    "prepare_reference_waveform",
)


def source_of(member: str) -> str:
    """A file of the wheel, extracted once beside it in the media cache."""
    target = media_cache_dir() / "fastvideo-0.2.1" / member.replace("/", "__")
    if not target.is_file():
        with zipfile.ZipFile(fetch_package(FASTVIDEO)) as wheel:
            atomic_write(target, wheel.read(member), replace=True)
    return target.read_text(encoding="utf-8")


def _definitions(member: str, names: tuple[str, ...]) -> dict[str, ast.AST]:
    tree = ast.parse(source_of(member))
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names}
    missing = set(names) - set(found)
    if missing:
        raise ImportError(f"{member} of {FASTVIDEO} defines no {sorted(missing)}")
    return found


def _constants(member: str) -> dict[str, Any]:
    """The module-level ``NAME = literal`` constants of a file (``MINIMAX_H3_FPS = 24`` ...)."""
    values: dict[str, Any] = {}
    for node in ast.parse(source_of(member)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                try:  # `768 * 1344` and the like: arithmetic of literals and constants seen before
                    values[node.targets[0].id] = eval(compile(ast.Expression(node.value), member, "eval"), {}, values)
                except Exception:  # noqa: BLE001 - a constant that is not plain arithmetic: not one these use
                    continue
    return values


def _run(member: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    module = ast.Module(body=list(_definitions(member, names).values()), type_ignores=[])
    exec(compile(module, member, "exec"), namespace)
    return namespace


def media(height: int, width: int) -> dict[str, Any]:
    """Its ``reference.py`` media functions (decode, 24 fps resample, frame prepare, waveform prepare), the canvas
    set to `height` x `width`."""
    namespace: dict[str, Any] = {"math": math, "np": np, "torch": torch, "Image": Image, "ImageOps": ImageOps}
    namespace |= {"Any": Any, "av": av, **_constants(PACKING), **_constants(REFERENCE)}
    namespace["resolve_canvas_size"] = lambda aspect_width, aspect_height: (height, width)
    return _run(REFERENCE, MEDIA_FUNCTIONS, namespace)


def build_parquet_record(height: int, width: int, frames: int) -> Any:
    """Its ``build_parquet_record`` with the script's geometry constants set to the test's (the script fixes 124
    frames of 768x1344)."""
    namespace: dict[str, Any] = {"Path": __import__("pathlib").Path, "Any": Any, "torch": torch}
    namespace |= _constants(OVERFIT) | {"MINIMAX_H3_FPS": _constants(PACKING)["MINIMAX_H3_FPS"]}
    namespace |= {"VIDEO_HEIGHT": height, "VIDEO_WIDTH": width, "NUM_FRAMES": frames}
    return _run(OVERFIT, ("build_parquet_record",), namespace)["build_parquet_record"]


def schema() -> ModuleType:
    """Its ``schema.py`` as a module (``pyarrow_schema_t2va``)."""
    source = source_of(SCHEMA)
    imported = {
        alias.name.split(".")[0] for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import)
        for alias in node.names
    }  # fmt: skip
    if imported - {"pyarrow"}:
        raise ImportError(f"{SCHEMA} of {FASTVIDEO} imports {sorted(imported)}")
    spec = importlib.util.spec_from_file_location(
        "fastvideo_schema", media_cache_dir() / "fastvideo-0.2.1" / SCHEMA.replace("/", "__")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
