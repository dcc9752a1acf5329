"""Demo shards in the VBVR layout, built from real video clips (see ``infra.demo.testmedia``).

A VBVR tar shard holds ``{generator}/{task}_task/{task}_{8 digits}/`` sample folders, each with
``ground_truth.mp4`` and ``prompt.txt`` (what the consumer reads) plus ``first_frame.png`` and
``metadata.json`` (which the consumer ignores). Clips are cut and re-encoded deterministically with
libx264 (one thread, bit-exact muxing), so the same frames, and on one build the same bytes, come
out every time. ``write_vbvr_tar`` is public so tests can craft hostile shards of their own.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import av

from infra.demo.testmedia import CLIPS, real_clip
from infra.errors import ConfigError
from infra.storage import atomic_file

log = logging.getLogger(__name__)

__all__ = ["GENERATORS", "DemoSample", "make_demo_data", "write_vbvr_tar"]

_MTIME = 1_704_067_200  # 2024-01-01T00:00:00Z: a fixed member time keeps shards byte-identical
_GEN_SUFFIX = "_data-generator"
# (generator, task): two task families, so a filter on "G-11" selects one of them.
GENERATORS: tuple[tuple[str, str], ...] = (
    ("G-11_handle_object_reappearance_data-generator", "handle_object_reappearance"),
    ("O-21_ball_trajectory_data-generator", "ball_trajectory"),
)


@dataclass(frozen=True)
class DemoSample:
    """One sample folder: ``files`` maps a file name inside the folder to its bytes."""

    generator: str
    task: str
    index: int
    files: dict[str, bytes]

    @property
    def sample_dir(self) -> str:
        """The folder inside the tar: ``{generator}/{task}_task/{task}_{index:08d}``."""
        return f"{self.generator}/{self.task}_task/{self.task}_{self.index:08d}"


class _ClipSpec(NamedTuple):
    clip: str  # a name from testmedia.CLIPS
    start: int  # first source frame kept
    frames: int | None  # frames kept; None copies the file's bytes unchanged
    width: int | None  # output width (height follows the aspect, rounded to even); None keeps it
    prompt: str


# Shot boundaries in bikes.mp4 (found by frame differencing): 0-29, 30-75, 76-136, 137-186, 187-241.
_SPECS: tuple[_ClipSpec, ...] = (
    _ClipSpec("bigbuckbunny", 0, 48, 320, "A large grey rabbit climbs out of its burrow on a grassy hill."),
    _ClipSpec("bigbuckbunny", 60, 64, 256, "A large grey rabbit stands in a sunny meadow and stretches."),
    _ClipSpec("carphone", 0, 40, None, "A man in a suit and red bow tie talks in the back seat of a car."),
    _ClipSpec("sample_1080p", 0, None, None, "A deer grazes on leafy bushes beside a gravel path."),
    _ClipSpec("bikes", 104, 33, 320, "A cyclist in a helmet waits in city traffic behind a grey van."),
    _ClipSpec("bikes", 187, 55, 320, "A pedestrian walks past a bicycle parked against a stone wall."),
    _ClipSpec("bikes", 137, 50, 240, "A green metal fence lines a city street with parked cars behind it."),
)
_BAD_SPEC = _ClipSpec("truncated_mkv", 0, None, None, "A deer walks along the edge of a forest.")


def _even(x: float) -> int:
    return max(2, round(x / 2) * 2)


def _cut_frames(src: Path, spec: _ClipSpec) -> tuple[list[av.VideoFrame], Fraction]:
    """Decode ``spec.frames`` frames from ``spec.start``, scaled to ``spec.width``, as yuv420p."""
    kept: list[av.VideoFrame] = []
    with av.open(str(src)) as inp:
        stream = inp.streams.video[0]
        rate = Fraction(stream.average_rate or 25)
        for i, frame in enumerate(inp.decode(stream)):
            if i < spec.start:
                continue
            if len(kept) >= (spec.frames or 0):
                break
            width = spec.width or frame.width
            height = _even(frame.height * width / frame.width)
            scaled = frame.reformat(width=_even(width), height=height, format="yuv420p")
            # A fresh frame drops what the source frame carries: its picture type (which libx264
            # honours as a forced frame type) and any side data.
            kept.append(av.VideoFrame.from_ndarray(scaled.to_ndarray(), format="yuv420p"))
    if len(kept) != spec.frames:
        raise ValueError(f"{src.name}: wanted {spec.frames} frames from {spec.start}, got {len(kept)}")
    return kept, rate


def _encode_h264(frames: list[av.VideoFrame], rate: Fraction) -> bytes:
    """Encode frames as H.264 yuv420p in MP4: one thread, no mbtree, bit-exact muxing (no encoder tag)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", container_options={"fflags": "+bitexact"}) as out:
        # mbtree=0: x264's macroblock tree made the bytes differ between runs on identical input.
        opts = {"crf": "26", "preset": "veryfast", "threads": "1", "x264-params": "mbtree=0"}
        stream = out.add_stream("libx264", rate=rate, options=opts)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        stream.codec_context.thread_count = 1
        for i, frame in enumerate(frames):
            frame.pts, frame.time_base = i, 1 / rate
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _probe(video: bytes) -> dict[str, object]:
    """Frame count, size and rate of a video, plus a small PNG of its first frame (if PIL is here).

    A file PyAV cannot open yields an empty dict: the corrupt sample just gets no PNG.
    """
    try:
        with av.open(io.BytesIO(video)) as c:
            stream = c.streams.video[0]
            frames = list(c.decode(stream))
            info: dict[str, object] = {"frames": len(frames), "width": frames[0].width}
            info |= {"height": frames[0].height, "fps": str(stream.average_rate)}
            try:
                image = frames[0].to_image()
            except ImportError:  # PIL is optional
                return info
    except (av.FFmpegError, IndexError):
        return {}
    image.thumbnail((64, 64))
    png = io.BytesIO()
    image.save(png, format="PNG")
    return info | {"png": png.getvalue()}


def _build_sample(spec: _ClipSpec, generator: str, task: str, index: int) -> DemoSample:
    src = real_clip(spec.clip)
    video = src.read_bytes() if spec.frames is None else _encode_h264(*_cut_frames(src, spec))
    info = _probe(video)
    png = info.pop("png", None)
    meta = {"generator": generator, "task": task, "sample_id": f"{task}_{index:08d}", "prompt": spec.prompt}
    meta |= {"source": {"clip": spec.clip, "member": CLIPS[spec.clip].member, "start_frame": spec.start}}
    meta |= info
    files = {
        "ground_truth.mp4": video,
        "prompt.txt": (spec.prompt + "\n").encode("utf-8"),
        "metadata.json": (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8"),
    }
    if isinstance(png, bytes):
        files["first_frame.png"] = png
    return DemoSample(generator, task, index, files)


def _tarinfo(name: str, size: int = 0, *, is_dir: bool = False) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, _MTIME, 0, 0, "", ""
    ti.type, ti.mode = (tarfile.DIRTYPE, 0o755) if is_dir else (tarfile.REGTYPE, 0o644)
    return ti


def write_vbvr_tar(path: Path, samples: Iterable[DemoSample], *, dir_entries: bool = True) -> Path:
    """Write ``samples`` as an uncompressed VBVR tar shard at ``path`` and return ``path``.

    Samples go in the order given, files sorted by name within each sample; every member has a
    fixed mtime, uid/gid 0 and mode 0o644 (0o755 for the folder entries written when
    ``dir_entries``). Names and bytes are written verbatim, so tests can build hostile shards.
    The shard appears atomically (temp file, then a hard link); an existing file raises
    ``FileExistsError``.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"refusing to overwrite existing shard {path}")
    with atomic_file(path) as fh, tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tf:  # type: ignore[arg-type]
        seen: set[str] = set()
        for sample in samples:
            _add_sample(tf, sample, seen if dir_entries else None)
    return path


def _add_sample(tf: tarfile.TarFile, sample: DemoSample, seen_dirs: set[str] | None) -> None:
    base = sample.sample_dir
    if seen_dirs is not None:
        parts = base.split("/")
        for depth in range(1, len(parts) + 1):
            d = "/".join(parts[:depth])
            if d not in seen_dirs:
                seen_dirs.add(d)
                tf.addfile(_tarinfo(d, is_dir=True))
    for fname in sorted(sample.files):
        data = sample.files[fname]
        tf.addfile(_tarinfo(f"{base}/{fname}", len(data)), io.BytesIO(data))


def _plan(out_dir: Path, n_shards: int, with_bad_sample: bool) -> list[tuple[Path, list[tuple]]]:
    """Split the clip specs into ``n_shards`` contiguous shards, alternating task families."""
    per, extra = divmod(len(_SPECS), n_shards)
    next_index = {gen: 0 for gen, _ in GENERATORS}
    plan, pos = [], 0
    for k in range(n_shards):
        generator, task = GENERATORS[k % len(GENERATORS)]
        specs = list(_SPECS[pos : pos + per + (k < extra)])
        pos += len(specs)
        if with_bad_sample and k == n_shards - 1:
            specs.append(_BAD_SPEC)
        first = next_index[generator]
        entries = [(spec, generator, task, first + i) for i, spec in enumerate(specs)]
        next_index[generator] = first + len(specs)
        name = f"{generator.removesuffix(_GEN_SUFFIX)}_{first:05d}-{first + len(specs) - 1:05d}.tar"
        plan.append((out_dir / name, entries))
    return plan


def make_demo_data(out_dir: Path, *, n_shards: int = 2, with_bad_sample: bool = True) -> list[Path]:
    """Write VBVR-layout demo shards of real clips into ``out_dir`` and return their paths.

    Seven good samples (bigbuckbunny, bikes, carphone cuts, and the 23-frame 1080p clip unchanged)
    are split over ``n_shards`` shards of alternating task families; with ``with_bad_sample`` the
    last shard also holds one sample whose ``ground_truth.mp4`` is a truncated Matroska file.
    Raises ``FileExistsError`` (before encoding anything) if a shard file already exists.
    """
    if not 1 <= n_shards <= len(_SPECS):
        raise ConfigError(f"n_shards must be between 1 and {len(_SPECS)}, got {n_shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = _plan(out_dir, n_shards, with_bad_sample)
    if existing := [str(p) for p, _ in plan if p.exists()]:
        raise FileExistsError(f"refusing to overwrite existing shards: {existing}")
    paths = []
    for path, entries in plan:
        samples = [_build_sample(*entry) for entry in entries]
        paths.append(write_vbvr_tar(path, samples))
        log.info("wrote %s (%d samples, %d bytes)", path.name, len(samples), path.stat().st_size)
    return paths
