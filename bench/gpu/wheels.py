"""The wheelhouse the GPU host lacks for a full `latentforge build`, packed to travel in one device transfer.

The host (bench/gpu/host-packages.txt: the packages of its image, Python 3.12, torch 2.11+cu130) has no Prefect, no
diffusers, no PyAV, no pydantic and most of Prefect's tree. ``bench/gpu/wheels.txt`` pins exactly what is missing:
the project's runtime requirements walked through their ``Requires-Dist`` (markers read for CPython 3.12 on
x86-64 Linux), stopping at every package the host has (its own requirements are met there), plus bitsandbytes for
``--load-text-encoder-in-8bit``. ``--lock`` writes that list from this environment's installed versions (the
versions the project's tests run with).

``python bench/gpu/wheels.py OUT`` downloads each pin (``pip download --no-deps``, cp312, manylinux x86-64) into the
test-media cache (`infra.demo.testmedia.media_cache_dir`/gpu-wheels) and writes the wheelhouse into OUT:

* every wheel re-compressed with LZMA instead of deflate (a wheel is a zip; pip reads LZMA members through
  `zipfile`; the files and their RECORD hashes are unchanged): 75.8 → 61.1 MB;
* trimmed where a part is never read by a build (`TRIM`): Prefect's two built UIs (the embedded server starts
  ``--no-ui``, `infra.ops.server.server_command`, and mounts no static files then) and bitsandbytes' native
  libraries for other CUDA, ROCm and XPU versions (it loads ``libbitsandbytes_cuda{torch.version.cuda}``: 130 on the
  host). A trimmed wheel's RECORD loses the dropped files' lines, so pip installs exactly what remains;
* without the packages in `DROP` (apprise: notification blocks only);
* each package once, so ``pip install --no-index --no-deps --target DIR OUT/*.whl`` installs it all at once.

It fails when the wheelhouse is over ``--max-mib`` (default `MAX_MIB`, what leaves room for the working tree and
the clips in one 64 MiB transfer) and prints one line: count, MiB, what was trimmed.

    python bench/gpu/wheels.py /work/main/.whl            # the wheelhouse (downloads once, then from the cache)
    python bench/gpu/wheels.py --lock                     # rewrite bench/gpu/wheels.txt from this environment
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import importlib.metadata as md
import io
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from infra.demo.testmedia import media_cache_dir  # noqa: E402

HERE = Path(__file__).resolve().parent
HOST_LIST, LOCK = HERE / "host-packages.txt", HERE / "wheels.txt"
#: What the host's 64 MiB transfer leaves for the wheels: the tracked tree (~2.1 MB), the clips (~2.6 MB) and room.
MAX_MIB = 58.0
PYTHON, PLATFORMS = "3.12", tuple(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35))
#: The host's interpreter as packaging's markers see it.
HOST_MARKERS = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
#: Beyond the project's requirements: the 8-bit text encoder's library (the [int8] extra; not installed on a CPU
#: machine, so pinned here: it needs torch, numpy and packaging, all the host's).
EXTRA_PINS = {"bitsandbytes": "0.50.2"}
#: Per package, the members (fnmatch patterns) a build never reads, and why.
TRIM: dict[str, tuple[tuple[str, ...], str]] = {
    "prefect": (("prefect/server/ui/*", "prefect/server/ui-v2/*"), "the UIs (the embedded server runs --no-ui)"),
    "bitsandbytes": (
        (
            "bitsandbytes/libbitsandbytes_cuda1[12]*.so",
            "bitsandbytes/libbitsandbytes_cuda13[1-9].so",
            "bitsandbytes/libbitsandbytes_rocm*.so",
            "bitsandbytes/libbitsandbytes_xpu*.so",
        ),
        "native libraries of other CUDA/ROCm/XPU versions (the host's torch is cu130)",
    ),
}


#: Whole packages a build never imports, and why (tests/test_gpu_wheels.py runs a build and its server with the
#: imports traced and finds none of them).
DROP: dict[str, str] = {
    "apprise": "notification blocks only: prefect.blocks.notifications imports it inside the methods that send",
}


def read_names(path: Path) -> dict[str, str | None]:
    """name → pinned version (None: not known) of a list of ``name`` or ``name==version`` lines."""
    names: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            names[canonicalize_name(name)] = version or None
    return names


def project_requirements() -> list[Requirement]:
    """The project's runtime requirements (pyproject.toml)."""
    import tomllib  # noqa: PLC0415 - only when the list is made

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(text) for text in declared]


def missing_tree(roots: Iterable[Requirement], host: Iterable[str]) -> dict[str, str]:
    """name → installed version of every distribution `roots` need on the host that the host lacks (`walk`)."""
    return walk(roots, host)[0]


def walk(roots: Iterable[Requirement], host: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(what the host lacks, the host's packages met on the way), each name → installed version: `roots` and their
    ``Requires-Dist`` walked in this environment (markers for the host's Python). A host package's own needs are met
    there; what an extra of it asks for (``httpx[http2]``) is walked, since the host may not have it."""
    have, found, met, seen = set(host), {}, {}, set()
    stack = list(roots)
    while stack:
        req = stack.pop()
        name, extras = canonicalize_name(req.name), tuple(sorted(req.extras))
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = md.distribution(req.name)  # PackageNotFoundError: this environment lacks a requirement
        (met if name in have else found)[name] = dist.version
        for text in dist.requires or []:
            child = Requirement(text)
            wanted = [
                extra
                for extra in ("", *extras)
                if child.marker is None or child.marker.evaluate(HOST_MARKERS | {"extra": extra})
            ]
            if wanted and (name not in have or wanted != [""]):  # a host package: only what its extras add
                stack.append(child)
    return dict(sorted(found.items())), dict(sorted(met.items()))


def write_lock(path: Path = LOCK) -> dict[str, str]:
    pins = missing_tree(project_requirements(), read_names(HOST_LIST)) | EXTRA_PINS
    header = "# Written by `python bench/gpu/wheels.py --lock`: what the GPU host lacks for `latentforge build`.\n"
    path.write_text(header + "".join(f"{name}=={version}\n" for name, version in pins.items()))
    return pins


def download(pins: dict[str, str], cache: Path) -> list[Path]:
    """The wheel of each pin for the host, from `cache` or downloaded there (``pip download --no-deps``)."""
    cache.mkdir(parents=True, exist_ok=True)
    wanted = {name: version for name, version in pins.items() if cached(cache, name, version) is None}
    if wanted:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off"]
        command += ["--python-version", PYTHON, "--implementation", "cp", "--dest", str(cache)]
        command += [arg for platform in (*PLATFORMS, "manylinux2014_x86_64") for arg in ("--platform", platform)]
        subprocess.run([*command, *(f"{n}=={v}" for n, v in wanted.items())], check=True)
    wheels = [cached(cache, name, version) for name, version in pins.items()]
    lost = [name for name, wheel in zip(pins, wheels, strict=True) if wheel is None]
    if lost:
        raise SystemExit(f"no wheel downloaded for {', '.join(lost)}")
    return wheels  # type: ignore[return-value]


def cached(cache: Path, name: str, version: str) -> Path | None:
    for wheel in sorted(cache.glob("*.whl")):
        got_name, got_version, _, _ = parse_wheel_filename(wheel.name)
        if got_name == name and str(got_version) == version:
            return wheel
    return None


def repack(wheel: Path, out: Path, drop: tuple[str, ...]) -> list[str]:
    """`wheel` into `out` with LZMA members, without the members matching `drop` (also gone from RECORD);
    returns the dropped names."""
    dropped: list[str] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out / wheel.name, "w", zipfile.ZIP_LZMA) as dst:
        record = next(i.filename for i in src.infolist() if i.filename.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if any(fnmatch.fnmatch(info.filename, pattern) for pattern in drop):
                dropped.append(info.filename)
            elif info.filename != record:
                dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)
        rows = [row for row in csv.reader(io.StringIO(src.read(record).decode())) if row and row[0] not in dropped]
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        dst.writestr(src.getinfo(record), text.getvalue(), compress_type=zipfile.ZIP_LZMA)
    return dropped


def build(out: Path, max_mib: float = MAX_MIB, lock: Path = LOCK) -> str:
    """Download (cached), trim and repack the locked wheels into `out`; the summary line."""
    pins = {name: version for name, version in read_names(lock).items() if version and name not in DROP}
    wheels = download(pins, media_cache_dir() / "gpu-wheels")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    trimmed = []
    for wheel in wheels:
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        patterns, why = TRIM.get(name, ((), ""))
        dropped = repack(wheel, out, patterns)
        if dropped:
            trimmed.append(f"{name}: {len(dropped)} files, {why}")
    size = sum(path.stat().st_size for path in out.glob("*.whl")) / 2**20
    line = (
        f"wheels: {len(wheels)} wheels {size:.1f} MiB in {out} (limit {max_mib:.0f} MiB)"
        f" | trimmed: {'; '.join(trimmed)} | dropped: {', '.join(DROP)}"
    )
    print(line)
    if size > max_mib:
        raise SystemExit(f"the wheelhouse is {size:.1f} MiB, over {max_mib:.0f} MiB")
    return line


def copy_media(dest: Path) -> str:
    """The clips bench/gpu/shot.py reads (`bench.gpu_bench.CLIP_NAMES`, 1080p among them), copied from the test-media
    cache into `dest` laid out as one (``LATENTFORGE_MEDIA_CACHE=dest`` on the host)."""
    from bench.gpu_bench import CLIP_NAMES  # noqa: PLC0415 - imports torch: only for this option
    from infra.demo.testmedia import real_clip  # noqa: PLC0415

    (dest / "clips").mkdir(parents=True, exist_ok=True)
    size = 0
    for name in CLIP_NAMES:
        clip = real_clip(name)
        (dest / "clips" / clip.name).write_bytes(clip.read_bytes())
        size += clip.stat().st_size
    return f"media: {len(CLIP_NAMES)} clips, {size / 2**20:.2f} MiB in {dest / 'clips'}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, help="the wheelhouse folder (ignored by git: e.g. .whl)")
    parser.add_argument("--lock", action="store_true", help="rewrite bench/gpu/wheels.txt from this environment")
    parser.add_argument("--max-mib", type=float, default=MAX_MIB)
    parser.add_argument("--media", type=Path, help="also copy the shot's clips there (a test-media cache to carry)")
    args = parser.parse_args(argv)
    if args.lock:
        pins = write_lock()
        print(f"wheels: {len(pins)} pins written to {LOCK}")
    if args.media is not None:
        print(copy_media(args.media))
    if args.out is not None:
        build(args.out, args.max_mib)
    elif not args.lock and args.media is None:
        parser.error("give OUT, or --lock")


if __name__ == "__main__":
    main()
