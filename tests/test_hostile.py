"""The hostile input corpus: one real build over real clips, PyAV-made variants and crafted bytes.

Every input ends as a ledger row with a precise reason (or done), the run finishes, nothing is written outside
OUT (and the sanity step's OUT.sanity), and the process's memory stays bounded while it runs. The corpus is built
here; tar members with ``../``, absolute paths and links have their own test (`tests/test_security.py`).
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import psutil
import pytest
from PIL import Image

import infra.sources.vbvr
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.cache.ledger import LedgerRow
from infra.config import BuildConfig
from infra.media.video import DEFAULT_MAX_FRAMES, DEFAULT_MAX_PIXELS, MediaError, MediaLimits, sample_frames
from infra.plan import make_spec
from tests.conftest import GENERATORS, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip, remux

#: Made-here clips: small, 12 frames (the real ones are cut to this too).
CLIP_FRAMES, SMALL_W, SMALL_H = 12, 96, 64
ODD_W, ODD_H = 97, 61
#: A real H.264 stream just over the default --max-pixels (4608² > 4096²): decoded, the 17 frames kept as RGB
#: would take 17 × 4608² × 3 bytes ≈ 1.08 GB. A Y4M header declaring 16000×16000 (15× the limit).
BIG_SIDE, DECLARED_SIDE = 4608, 16000
DECLARED_FRAMES = 1_000_000  # an MP4 whose `stts` declares this many frames (10× the default --max-frames)
LONG_PROMPT_WORDS = 3000  # far more tokens than text_max_length (512), well under MAX_PROMPT_BYTES
HUGE_PROMPT = 3 << 19  # 1.5 MiB: over MAX_PROMPT_BYTES (1 MiB)
#: Peak growth of this process's RSS during the build. The tiny model and the small clips need about a third of
#: it; decoding the 4608² clip alone would need about four times it.
MEMORY_BOUND_MB = 300
WEBM_CODECS = {"vp8": "libvpx", "vp9": "libvpx-vp9", "av1": "libsvtav1"}


# ----------------------------------------------------------------------------- making the corpus


def _picture(index: int, width: int, height: int) -> np.ndarray:
    """A moving bar over a fixed gradient (so every frame differs and every codec has something to code)."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    picture = np.broadcast_to((x + y) / 2, (height, width, 3)).astype(np.uint8).copy()
    left = (index * 7) % width
    picture[:, left : left + max(width // 8, 1)] = (250, 40, 40)
    return picture


def encode(codec: str, container: str, width: int, height: int, pix_fmt: str, **how: Any) -> bytes:
    """CLIP_FRAMES frames encoded with PyAV; `how`: rotation (display matrix, degrees counter-clockwise), options."""
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as dst:
        stream = dst.add_stream(codec, rate=Fraction(25, 1), options=how.get("options", {}))
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if "rotation" in how:
            stream.set_display_rotation(how["rotation"])
        for i in range(CLIP_FRAMES):
            frame = av.VideoFrame.from_ndarray(_picture(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out.getvalue()


def big_h264() -> bytes:
    """Two black BIG_SIDE² frames, really encoded (x264 ultrafast: ~0.6 s here)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as dst:
        stream = dst.add_stream("libx264", rate=Fraction(25, 1), options={"preset": "ultrafast", "threads": "1"})
        stream.width = stream.height = BIG_SIDE
        stream.pix_fmt = "yuv420p"
        frame = av.VideoFrame(BIG_SIDE, BIG_SIDE, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for pts in range(2):
            frame.pts = pts
            for packet in stream.encode(frame):
                dst.mux(packet)
        for packet in stream.encode():
            dst.mux(packet)
    return out.getvalue()


def declared_huge_y4m() -> bytes:
    """A YUV4MPEG2 header declaring DECLARED_SIDE² 4:2:0 frames, then the start of one frame."""
    return f"YUV4MPEG2 W{DECLARED_SIDE} H{DECLARED_SIDE} F25:1 Ip A1:1 C420jpeg\nFRAME\n".encode() + bytes(4096)


def declaring_frames(mp4: bytes, frames: int) -> bytes:
    """The same MP4 with its `stts` box's first entry claiming `frames` samples (the header's frame count)."""
    at = mp4.index(b"stts") + 4 + 4 + 4  # box type, version + flags, entry count: the first entry's sample count
    return mp4[:at] + frames.to_bytes(4, "big") + mp4[at + 4 :]


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(_picture(0, SMALL_W, SMALL_H)).save(buffer, format="PNG")
    return buffer.getvalue()


def truncated_tar(path: Path, samples: list) -> Path:
    """A shard cut in the middle of its second sample's video member."""
    make_shards(path.parent, {path.stem: samples})
    with tarfile.open(path) as tf:
        second = [m for m in tf.getmembers() if m.name.endswith("/ground_truth.mp4")][1]
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: second.offset_data + second.size // 2])
    return path


def webm_codecs() -> dict[str, str]:
    """The WebM codecs of WEBM_CODECS this PyAV build can encode (and decode)."""
    available = av.codecs_available
    return {name: enc for name, enc in WEBM_CODECS.items() if enc in available and name in available}


def corpus(clips: dict[str, bytes]) -> tuple[dict[str, list], dict[tuple[str, int], str]]:
    """{shard: samples} and {(shard, index): the reason expected ("done" for a fine input)}."""
    good = cut_clip(clips["carphone"], CLIP_FRAMES)
    prompt = b"a hostile corpus sample"
    media: list[tuple[str, bytes | None, str]] = [
        ("good", good, "done"),
        ("truncated_mkv", clips["truncated_mkv"], "video_decode_error"),
        ("truncated_mp4", clips["sample_1080p"][: len(clips["sample_1080p"]) // 2], "video_decode_error"),
        ("audio_only", clips["audio_only"], "no_video_stream"),
        ("zero_bytes", b"", "empty_video"),
        ("png_named_mp4", png_bytes(), "not_a_video"),
        ("declared_16000x16000", declared_huge_y4m(), "too_many_pixels"),
        ("real_4608x4608", big_h264(), "too_many_pixels"),
        ("declares_1e6_frames", declaring_frames(good, DECLARED_FRAMES), "too_many_frames"),
        ("10bit", encode("libx264", "mp4", SMALL_W, SMALL_H, "yuv420p10le"), "done"),
        ("yuv444", encode("libx264", "mp4", SMALL_W, SMALL_H, "yuv444p"), "done"),
        ("odd_97x61", encode("mpeg4", "mp4", ODD_W, ODD_H, "yuv420p"), "done"),
        ("rotated_90", encode("libx264", "mp4", SMALL_W, SMALL_H, "yuv420p", rotation=90), "done"),
    ]
    for name, encoder in webm_codecs().items():
        media.append((f"webm_{name}", encode(encoder, "webm", SMALL_W, SMALL_H, "yuv420p"), "done"))
    words = " ".join(f"word{i}" for i in range(LONG_PROMPT_WORDS)).encode()
    prompts = [
        (b"caf\xe9 \xff\xfe", "prompt_not_utf8"),
        (b" \n\t \r\n", "empty_prompt"),
        (words, "done"),
        (b"x" * HUGE_PROMPT, "prompt_too_long"),
    ]
    shards: dict[str, list] = {
        "a-media": [sample(0, i, video, prompt) for i, (_, video, _) in enumerate(media)],
        "b-prompts": [sample(1, i, good, text) for i, (text, _) in enumerate(prompts)],
        # the same group and id in two shards
        "c-dup-1": [sample(0, 900, good, b"the first copy")],
        "c-dup-2": [sample(0, 900, good, b"the second copy")],
        "d-truncated": [sample(1, 100 + i, good, prompt) for i in range(3)],
        "e-vanishes": [sample(1, 200 + i, good, prompt) for i in range(3)],
        "f-grows": [sample(1, 300 + i, good, prompt) for i in range(3)],
        "g-touched": [sample(1, 400 + i, good, prompt) for i in range(3)],
    }
    expected = {("a-media", i): reason for i, (_, _, reason) in enumerate(media)}
    expected |= {("b-prompts", i): reason for i, (_, reason) in enumerate(prompts)}
    expected |= {("d-truncated", 100): "done", ("d-truncated", 101): "shard_truncated"}
    for shard, first, reason in (("e-vanishes", 200, "shard_vanished"), ("f-grows", 300, "shard_changed")):
        expected |= {(shard, first): "done", (shard, first + 1): reason, (shard, first + 2): reason}
    expected |= {("g-touched", 400): "done", ("g-touched", 401): "shard_changed", ("g-touched", 402): "shard_changed"}
    expected |= {("c-dup-1", 900): "done", ("c-dup-2", 900): "duplicate_id"}
    names = {("a-media", i): name for i, (name, _, _) in enumerate(media)}
    return shards, expected | {("names", 0): names}  # type: ignore[dict-item]


# ----------------------------------------------------------------------------- the build


class PeakRss:
    """Samples this process's RSS every few milliseconds in a thread; `peak_growth_mb` over the start."""

    def __init__(self, every: float = 0.005) -> None:
        self.process, self.every = psutil.Process(), every
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.every)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def peak_growth_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def _files_outside(root: Path, inside: tuple[Path, ...]) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(root).items() if not any((root / k).is_relative_to(p) for p in inside)}


@pytest.fixture(scope="module")
def hostile_build(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> Iterator:
    """One build over the whole corpus, the shards e/f/g made to vanish, grow and be touched after their first
    sample's video was read."""
    root = tmp_path_factory.mktemp("hostile")
    shards, expected = corpus(clips)
    names = expected.pop(("names", 0))
    src = root / "src"
    make_shards(src, {k: v for k, v in shards.items() if k != "d-truncated"})
    truncated_tar(src / "d-truncated.tar", shards["d-truncated"])
    out = root / "out"
    before = _files_outside(root, ())
    real_read = infra.sources.vbvr._read
    upsets = {"e-vanishes": lambda p: p.unlink(), "f-grows": _grow, "g-touched": _touch}
    done: set[str] = set()

    def read_then_upset(tf, path, member, identity, shard, max_mb):  # the reader's own signature
        data = real_read(tf, path, member, identity, shard, max_mb)
        if shard.id in upsets and shard.id not in done and member is not None and path.endswith(".mp4"):
            done.add(shard.id)
            upsets[shard.id](Path(shard.path))
        return data

    mp = pytest.MonkeyPatch()
    mp.setattr(infra.sources.vbvr, "_read", read_then_upset)
    started = time.perf_counter()
    try:
        with PeakRss() as memory:
            ok, result = run_build(config(src, tiny_model, out))
    finally:
        mp.undo()
    seconds = time.perf_counter() - started
    written_outside = {
        k: v
        for k, v in _files_outside(root, (out, root / "out.sanity")).items()
        if before.get(k) != v and not k.startswith(("src/f-grows", "src/g-touched"))  # the test's own upsets
    }
    rows = {shard: ledger.read_shard(out, shard) for shard in shards}
    yield {
        "ok": ok,
        "result": result,
        "rows": rows,
        "expected": expected,
        "names": names,
        "memory": memory,
        "seconds": seconds,
        "outside": written_outside,
        "out": out,
    }


def _grow(path: Path) -> None:
    with path.open("ab") as fh:  # a tar with more zero blocks at its end: still a readable tar, not the one listed
        fh.write(bytes(1024))


def _touch(path: Path) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))


def _row(rows: dict[str, dict[str, LedgerRow]], shard: str, index: int) -> LedgerRow:
    found = [r for r in rows[shard].values() if r.id.endswith(f"_{index:08d}")]
    assert len(found) == 1, (shard, index, list(rows[shard]))
    return found[0]


# ----------------------------------------------------------------------------- the checks


def test_every_hostile_input_is_a_ledger_row_with_its_reason_and_the_run_finishes(hostile_build):
    build = hostile_build
    assert build["ok"], build["result"]
    rows, names = build["rows"], build["names"]
    got = {}
    for (shard, index), reason in build["expected"].items():
        row = _row(rows, shard, index)
        got[(shard, index)] = row.reason or row.status
        if reason == "done":
            assert row.status == "done" and row.reason is None, (shard, names.get((shard, index)), row)
        else:
            assert row.status == "skipped" and row.detail, (shard, names.get((shard, index)), row)
    assert got == build["expected"]
    # d-truncated's third sample is past the cut: no listing can know of it (the shard's problem is reported)
    assert len(rows["d-truncated"]) == 2
    result = build["result"]
    assert result["failed"] == 0
    assert build["seconds"] < 120


def test_limits_are_refused_from_the_header_before_decoding(hostile_build):
    rows, names = hostile_build["rows"], hostile_build["names"]
    by_name = {name: _row(rows, shard, index) for (shard, index), name in names.items()}
    assert f"{DECLARED_SIDE}x{DECLARED_SIDE}" in by_name["declared_16000x16000"].detail
    assert f"--max-pixels is {DEFAULT_MAX_PIXELS}" in by_name["real_4608x4608"].detail
    assert f"header declares {DECLARED_FRAMES} frames" in by_name["declares_1e6_frames"].detail


def test_memory_stays_bounded_and_nothing_is_written_outside_out(hostile_build):
    growth, inputs = hostile_build["memory"].peak_growth_mb, len(hostile_build["expected"])
    print(f"hostile corpus: {inputs} inputs, build {hostile_build['seconds']:.1f} s, peak RSS growth {growth:.0f} MiB")
    assert growth < MEMORY_BOUND_MB, growth
    assert hostile_build["outside"] == {}
    out = hostile_build["out"]
    assert all(p.resolve().is_relative_to(out.resolve()) for p in out.rglob("*"))


def test_rotation_is_recorded_not_applied(hostile_build):
    rows, names = hostile_build["rows"], hostile_build["names"]
    by_name = {name: _row(rows, shard, index) for (shard, index), name in names.items()}
    rotated, plain = by_name["rotated_90"], by_name["yuv444"]
    assert rotated.extra["sampling"]["rotation"] == 90
    assert "rotation" not in plain.extra["sampling"]
    assert rotated.source_shape == [CLIP_FRAMES, SMALL_H, SMALL_W, 3]  # stored orientation: not turned


@pytest.mark.parametrize("codec", sorted(WEBM_CODECS))
def test_webm_codecs(hostile_build, codec):
    if codec not in webm_codecs():
        pytest.skip(f"this PyAV build cannot encode {codec} ({WEBM_CODECS[codec]} not in av.codecs_available)")
    rows, names = hostile_build["rows"], hostile_build["names"]
    (key,) = [k for k, name in names.items() if name == f"webm_{codec}"]
    row = _row(rows, *key)
    assert row.status == "done" and row.source_shape == [CLIP_FRAMES, SMALL_H, SMALL_W, 3]


def test_prompts_over_length_are_truncated_and_recorded(hostile_build):
    row = _row(hostile_build["rows"], "b-prompts", 2)
    assert row.truncated and row.tokens_total > 512, row


def test_the_limits_have_defaults_stay_out_of_the_fingerprint_and_count_packets(tmp_path, tiny_model, clips):
    """Defaults agree; the fingerprint ignores the limits; a container without a frame count is refused by its
    packets (demuxed, not decoded); a real clip over a lowered --max-pixels is refused by its header."""
    assert BuildConfig.settings()["max_pixels"].default == DEFAULT_MAX_PIXELS
    assert BuildConfig.settings()["max_frames"].default == DEFAULT_MAX_FRAMES
    base = config(tmp_path / "src", tiny_model, tmp_path / "out")
    tight = base.with_values(max_pixels=1, max_frames=1)
    assert make_spec(base)[1].fingerprint() == make_spec(tight)[1].fingerprint()
    bikes = clips["bikes"]  # 640x272, 250 frames
    mkv = remux(bikes, "matroska")  # no frame count in its header
    with av.open(io.BytesIO(mkv)) as container:
        assert container.streams.video[0].frames == 0
    with pytest.raises(MediaError) as err:
        sample_frames(mkv, 17, limits=MediaLimits(max_frames=100))
    assert err.value.reason == "too_many_frames" and "more than 100 packets" in err.value.detail
    with pytest.raises(MediaError) as err:
        sample_frames(bikes, 17, limits=MediaLimits(max_pixels=320 * 240))
    assert err.value.reason == "too_many_pixels" and "640x272" in err.value.detail
    assert sample_frames(bikes, 17, limits=MediaLimits(max_pixels=640 * 272, max_frames=250)).source_frames == 250


def test_a_duplicate_id_across_shards_is_refused_and_the_first_is_encoded(hostile_build):
    first, second = _row(hostile_build["rows"], "c-dup-1", 900), _row(hostile_build["rows"], "c-dup-2", 900)
    assert first.status == "done" and first.source.read_sha256  # the first copy's bytes were read and encoded
    assert second.path is None and not second.source.read_sha256  # the second's never were
    assert f"c-dup-1/{GENERATORS[0]}/" in second.detail
