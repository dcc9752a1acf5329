"""The ``ffmpeg`` program DiffSynth-Studio's video reader runs (tests only): its ``LoadVideo`` calls
``imageio.get_reader``, whose FFMPEG plugin pipes frames out of the ``ffmpeg`` executable that ``imageio-ffmpeg``
ships (``imageio[ffmpeg]`` is a requirement of the ``diffsynth`` package). ``pip download --no-deps`` puts that wheel
into the test-media cache (`fetch_package`); its files are extracted beside it and the package put on ``sys.path``;
``IMAGEIO_FFMPEG_EXE`` names its executable. The program turns a clip with a display matrix upright (its autorotate:
the reader passes no ``-noautorotate``), which PyAV does not."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import sys
import tempfile
import zipfile
from pathlib import Path

from infra.demo.testmedia import fetch_package, media_cache_dir

WHEEL = "imageio-ffmpeg==0.6.0"
FOLDER = "imageio-ffmpeg-0.6.0"


@functools.cache
def ffmpeg_exe() -> Path:
    """The wheel's ``ffmpeg`` executable (extracted once, made executable), named by ``IMAGEIO_FFMPEG_EXE``, its
    package importable."""
    target = media_cache_dir() / FOLDER
    if not (target / "imageio_ffmpeg" / "__init__.py").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".iioff-", dir=media_cache_dir()))
        try:
            with zipfile.ZipFile(fetch_package(WHEEL)) as wheel:
                wheel.extractall(staging)
            if not target.exists():
                staging.replace(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    exe = next((target / "imageio_ffmpeg" / "binaries").glob("ffmpeg-*"))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    os.environ["IMAGEIO_FFMPEG_EXE"] = str(exe)
    if str(target) not in sys.path:
        sys.path.append(str(target))
    return exe
